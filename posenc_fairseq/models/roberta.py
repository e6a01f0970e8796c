"""`posenc_roberta`: fairseq's RobertaModel with PositionalAttention.

Registers, for every encoding NAME, `roberta_NAME` and `roberta_NAME_base` (BERT-base size),
`roberta_NAME_large`, `roberta_NAME_prenorm` and `roberta_NAME_xlm` (fairseq's RoBERTa sizes; its
`xlm`, whose name lacks the `roberta` prefix, becomes the suffix `_xlm`).
"""
from fairseq.models import register_model
from fairseq.models.roberta import RobertaEncoder, RobertaModel
from fairseq.models.roberta import model as stock
from fairseq.modules.transformer_sentence_encoder import init_bert_params

from ..encodings.option_types import OptionValueError
from .common import PositionalTransformerEncoder, add_position_args, attach_encoding, register_architectures
from .loading import EncodingStateMixin

SIZES = {
    "": stock.base_architecture,
    "_prenorm": stock.roberta_prenorm_architecture,
    "_base": stock.roberta_base_architecture,
    "_large": stock.roberta_large_architecture,
    "_xlm": stock.xlm_architecture,
}


class PositionalRobertaEncoder(RobertaEncoder):
    def build_encoder(self, args, dictionary, embed_tokens):
        encoder = PositionalTransformerEncoder(args, dictionary, embed_tokens)
        encoder.apply(init_bert_params)
        return encoder


@register_model("posenc_roberta")
class PositionalRobertaModel(EncodingStateMixin, RobertaModel):
    stock_converter = "scripts/convert_roberta_checkpoint.py"

    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        add_position_args(parser)

    @classmethod
    def build_model(cls, args, task):
        # as RobertaModel.build_model, with our encoder
        stock.base_architecture(args)
        if getattr(args, "max_positions", None) is None:
            tokens_per_sample = getattr(args, "tokens_per_sample", None)
            args.max_positions = task.max_positions() if tokens_per_sample is None else tokens_per_sample
        if not isinstance(args.max_positions, int):  # (stock fails later on the sum of a tuple and an int)
            raise OptionValueError(f"--arch {args.arch}: RoBERTa reads one sequence, but --task {args.task} gives "
                                   f"pairs (max positions {args.max_positions}): use a single-sequence task "
                                   "(masked_lm, sentence_prediction, sentence_ranking)")
        model = cls(args, PositionalRobertaEncoder(args, task.source_dictionary))
        attach_encoding(model, args, model.encoder.sentence_encoder)
        return model


register_architectures("posenc_roberta", "roberta", SIZES)
