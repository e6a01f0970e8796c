"""`posenc_transformer`: fairseq's encoder-decoder TransformerModel with PositionalAttention.

Registers, for every encoding NAME, the architectures `transformer_NAME` (base size) and
`transformer_NAME_SIZE` for each of fairseq's sizes (the keys of SIZES).
"""
from fairseq.models import register_model
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer import transformer_legacy as stock

from .common import (PositionalTransformerDecoder, PositionalTransformerEncoder, add_position_args, attach_encoding,
                     register_architectures)
from .loading import EncodingStateMixin

SIZES = {
    "": stock.base_architecture,
    "_tiny": stock.tiny_architecture,
    "_iwslt_de_en": stock.transformer_iwslt_de_en,
    "_wmt_en_de": stock.transformer_wmt_en_de,
    "_vaswani_wmt_en_de_big": stock.transformer_vaswani_wmt_en_de_big,
    "_vaswani_wmt_en_fr_big": stock.transformer_vaswani_wmt_en_fr_big,
    "_wmt_en_de_big": stock.transformer_wmt_en_de_big,
    "_wmt_en_de_big_t2t": stock.transformer_wmt_en_de_big_t2t,
}


@register_model("posenc_transformer")
class PositionalTransformerModel(EncodingStateMixin, TransformerModel):
    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_position_args(parser)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return PositionalTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return PositionalTransformerDecoder(args, tgt_dict, embed_tokens,
                                            no_encoder_attn=getattr(args, "no_cross_attention", False))

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        attach_encoding(model, args, model.encoder, model.decoder)
        return model


register_architectures("posenc_transformer", "transformer", SIZES)
