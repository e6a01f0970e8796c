"""`posenc_lm`: fairseq's decoder-only TransformerLanguageModel with PositionalAttention.

Registers, for every encoding NAME, `transformer_lm_NAME` (fairseq's `transformer_lm`: the options'
defaults of its config, post-norm) and
`transformer_lm_NAME{SUFFIX}` for each of fairseq's LM sizes (`_big`, `_wiki103`, `_gbw`, `_gpt`,
`_gpt2_small` ... `_gpt3_175`, the list in SIZES). The one encoding module serves the decoder's
self-attention in the 'decoder' role (causal; there is no encoder and no cross-attention).

Positions are those of the tokens in the model's input, counted from 0 over non-padding tokens:
with `fairseq-eval-lm --context-window C` each window (up to C context tokens, then the scored
block) starts at position 0, as in stock fairseq, and the relative encodings see the true
distances inside the window.
"""
import dataclasses
from unittest import mock

from fairseq.models import register_model
from fairseq.models import transformer_lm as stock
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig

from .common import PositionalTransformerDecoder, add_position_args, attach_encoding, register_architectures
from .loading import EncodingStateMixin


def transformer_lm_architecture(args):
    """What `--arch transformer_lm` gives in stock fairseq: that name is the no-op architecture of
    TransformerLanguageModelConfig, so every unset option takes the dataclass default (post-norm,
    decoder input/output dims 512 whatever --decoder-embed-dim is), not base_lm_architecture's
    (pre-norm), which the named sizes use. Values tied to the task (tokens_per_sample, ...) are left
    to the task's options."""
    for field in dataclasses.fields(TransformerLanguageModelConfig):
        if hasattr(args, field.name):
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            continue
        if isinstance(default, str) and default.startswith("${"):
            continue
        setattr(args, field.name, default)


SIZES = {
    "": transformer_lm_architecture,
    "_big": stock.transformer_lm_big,
    "_wiki103": stock.transformer_lm_baevski_wiki103,
    "_baevski_wiki103": stock.transformer_lm_baevski_wiki103,
    "_gbw": stock.transformer_lm_baevski_gbw,
    "_baevski_gbw": stock.transformer_lm_baevski_gbw,
    "_gpt": stock.transformer_lm_gpt,
    "_gpt2_tiny": stock.transformer_lm_gpt2_tiny,
    "_gpt2_small": stock.transformer_lm_gpt2_small,
    "_gpt2_medium": stock.transformer_lm_gpt2_medium,
    "_gpt2_big": stock.transformer_lm_gpt2_big,
    "_gpt2_big_wide": stock.transformer_lm_gpt2_big_wide,
    "_gpt2_bigger": stock.transformer_lm_gpt2_bigger,
    "_gpt3_small": stock.transformer_lm_gpt3_small,
    "_gpt3_medium": stock.transformer_lm_gpt3_medium,
    "_gpt3_large": stock.transformer_lm_gpt3_large,
    "_gpt3_xl": stock.transformer_lm_gpt3_xl,
    "_gpt3_2_7": stock.transformer_lm_gpt3_2_7,
    "_gpt3_6_7": stock.transformer_lm_gpt3_6_7,
    "_gpt3_13": stock.transformer_lm_gpt3_13,
    "_gpt3_175": stock.transformer_lm_gpt3_175,
}


@register_model("posenc_lm")
class PositionalLanguageModel(EncodingStateMixin, TransformerLanguageModel):
    stock_converter = "scripts/convert_transformer_lm_checkpoint.py"

    @classmethod
    def add_args(cls, parser):
        TransformerLanguageModel.add_args(parser)  # the options of fairseq's TransformerLanguageModelConfig
        add_position_args(parser)

    @classmethod
    def build_model(cls, args, task):
        if getattr(args, "max_target_positions", None) is None:
            # as stock's build: the model config's tokens_per_sample (a checkpoint's: the length it was
            # trained at, whatever the task loading it asks, e.g. fairseq-eval-lm --tokens-per-sample),
            # which stock's config takes from the task (`${task.tokens_per_sample}`); fairseq-hydra-train
            # gives this model no such option: the task's then, where stock's build falls back to 1024
            tokens_per_sample = getattr(args, "tokens_per_sample", None)
            if tokens_per_sample is None:
                task_options = getattr(task, "cfg", None)
                if task_options is None:  # (fairseq's legacy tasks keep their options as `args`)
                    task_options = getattr(task, "args", None)
                tokens_per_sample = getattr(task_options, "tokens_per_sample", None)
            if tokens_per_sample is not None:
                args.max_target_positions = tokens_per_sample
        # fairseq's own build (embeddings, adaptive input, ...) with our decoder class in place of
        # TransformerDecoder: the same modules, parameters and random initialisation as stock (its
        # build_model names the class and offers no hook; copying it would fall behind fairseq's)
        with mock.patch.object(stock, "TransformerDecoder", PositionalTransformerDecoder):
            model = super().build_model(args, task)
        attach_encoding(model, args, decoder_stack=model.decoder)
        return model


register_architectures("posenc_lm", "transformer_lm", SIZES)
