"""What the translation, language and RoBERTa models share: options, stacks that tell the encoding
the token positions, attaching one encoding to a model, and registering architectures. (Loading
weights into them: loading.py.)"""
import argparse
import contextlib
import copy
import hashlib
import logging
from typing import Optional

import torch
from torch import Tensor, nn

from fairseq.models import register_model_architecture
from fairseq.models.transformer import TransformerDecoder, TransformerEncoder
from fairseq.modules import LearnedPositionalEmbedding

from ..attention import bound_attentions, use_positional_attention
from ..layer_checkpoint import checkpoint_layer
from ..encodings import ENCODINGS, ModelDims, build_encoding, options_of_other_encodings
from ..encodings.base import encoding_class, hook_use, overrides
from ..encodings.option_types import OptionValueError
from ..encodings.positions import AnyPositions, PaddedPositions, shared_range, tensor_of
from .loading import keeps_stock_input, take_allow_encoding_change

INPUT_POSITIONS = ("none", "sinusoidal", "learned", "stock")


def add_position_args(parser: argparse.ArgumentParser):
    parser.add_argument("--positional-encoding", choices=sorted(ENCODINGS), metavar="NAME",
                        help="position information inside attention: " + ", ".join(sorted(ENCODINGS)))
    parser.add_argument("--input-positions", choices=INPUT_POSITIONS,
                        help="absolute embedding added to the input tokens (fairseq's own modules); "
                             "'stock' keeps the base architecture's; default: what fairseq's own "
                             "--no-token-positional-embeddings / --encoder-learned-pos / --decoder-learned-pos ask "
                             "where given, else the encoding's choice")
    # (the choice that last set fairseq's flags, stored with the model: see set_position_defaults)
    parser.add_argument("--input-positions-flags", choices=INPUT_POSITIONS, help=argparse.SUPPRESS)
    # (the encoding's default where nothing asked for a choice: see set_position_defaults)
    parser.add_argument("--input-positions-default", choices=INPUT_POSITIONS, help=argparse.SUPPRESS)
    parser.add_argument("--allow-encoding-change", action="store_true", default=None,
                        help="load weights (--restore-file, --finetune-from-model) trained with another encoding or "
                             "other values of its options than this model's defaults, as a deliberate change; "
                             "without it such a load is refused (encodings/trained_with.py). For this run's loads "
                             "only: not saved with the model")
    for name in sorted(ENCODINGS):
        ENCODINGS[name].add_args(parser)


def set_position_defaults(args, encoding: str, stacks=("encoder", "decoder")):
    """Architecture defaults; must run before fairseq's base architecture fills in the rest. The input
    embedding: --input-positions where given (also from a stored config), else what fairseq's own
    flags ask (`fairseq_input_positions`), else the encoding's choice. fairseq's flags are then set to
    the choice (what fairseq's modules read) and `input_positions_flags` records it, so that a stored
    config's flags are told apart from a user's (--model-overrides): flags that ask something else
    than the choice are refused, never silently overruled."""
    given = getattr(args, "positional_encoding", None)
    args.positional_encoding = encoding if given is None else given
    encoding_class(args.positional_encoding)
    asked = fairseq_input_positions(args, stacks)
    written = getattr(args, "input_positions_flags", None)
    if written is not None and written not in INPUT_POSITIONS:  # (a stored config or an override)
        raise OptionValueError(f"--input-positions-flags {written}: expected one of {', '.join(INPUT_POSITIONS)}")
    if written is not None and asked == _flags_of(written):
        asked = None  # the flags this package wrote for the stored choice: not a request
    choice = getattr(args, "input_positions", None)
    if choice is None:
        choice = asked
    if choice is None:
        # recorded, so that a later load can tell the default from a choice (`check_stock_input_kept`)
        choice = args.input_positions_default = encoding_class(args.positional_encoding).default_input_positions
    if choice not in INPUT_POSITIONS:  # (argparse checks the command line; a stored config or an override, here)
        raise OptionValueError(f"--input-positions {choice}: expected one of {', '.join(INPUT_POSITIONS)}")
    if asked is not None and asked != choice and choice != "stock" and not (choice, asked) == ("learned", "stock"):
        flags = [f"--{name.replace('_', '-')}" for name in
                 ["no_token_positional_embeddings", *(f"{stack}_learned_pos" for stack in stacks)]
                 if getattr(args, name, False)]
        raise OptionValueError(
            f"--input-positions {choice} contradicts fairseq's {' '.join(flags)} (which ask for '{asked}'): give one "
            f"of them (for a stored checkpoint, override input_positions: --model-overrides "
            f"\"{{'input_positions': '{asked}'}}\")")
    args.input_positions = choice
    args.input_positions_flags = choice if choice != "stock" else None
    if choice == "none":
        args.no_token_positional_embeddings = True
    elif choice in ("sinusoidal", "learned"):
        args.no_token_positional_embeddings = False
        for stack in stacks:  # (a model without a stack has none of its flags, as stock's)
            setattr(args, f"{stack}_learned_pos", choice == "learned")


def _flags_of(choice: str) -> Optional[str]:
    """What fairseq's flags ask (`fairseq_input_positions`) once `set_position_defaults` set them for `choice`."""
    return {"none": "none", "sinusoidal": None, "learned": "learned", "stock": "stock"}[choice]


#: the stacks of each model family (register_architectures' model names), whose --STACK-learned-pos fairseq reads
STACKS = {"posenc_transformer": ("encoder", "decoder"), "posenc_lm": ("decoder",), "posenc_roberta": ("encoder",)}


def fairseq_input_positions(args, stacks=("encoder", "decoder")) -> Optional[str]:
    """What fairseq's own flags ask of the input embedding of a model with `stacks`, where they ask
    something (they are off unless given): 'none' for --no-token-positional-embeddings, 'learned'
    where every stack's --STACK-learned-pos is on, 'stock' where some are (fairseq's mix); else None."""
    if getattr(args, "no_token_positional_embeddings", False):
        return "none"
    learned = [bool(getattr(args, f"{stack}_learned_pos", False)) for stack in stacks]
    if all(learned):
        return "learned"
    return "stock" if any(learned) else None


def token_positions(tokens: Tensor, padding_idx: int) -> AnyPositions:
    """0-based position of each token among the non-padding tokens of its row (pads get 0), so
    left- and right-padded batches give every real token the same position."""
    return real_token_positions(tokens.ne(padding_idx))


def real_token_positions(real: Tensor) -> AnyPositions:
    """`token_positions` from the (B, T) mask of real tokens; a `shared_range` 0..T-1 when every
    row's real tokens come first and some row has no padding (an unpadded or right-padded batch:
    the real tokens' positions are the same, and the pads after a row's last real token continue
    its count, which nothing reads: pads are masked as keys and their outputs dropped), else
    `PaddedPositions` with the longest row's count. One host read per stack for both facts, as
    fairseq's own padding checks; an encoding then computes one row for the whole batch, or reads
    the bounds, without another."""
    in_order = (real[:, 1:] <= real[:, :-1]).all() & real[:, -1].any()
    longest = int(torch.where(in_order, -1, real.sum(dim=1).max()))
    if longest < 0:
        return shared_range(real.size(0), 0, real.size(1), real.device)
    return PaddedPositions(((real.cumsum(dim=1) - 1) * real).long(), max(longest, 1))


def check_length(embed_positions, tokens, padding_idx, limit: int):
    """A learned absolute table cannot extrapolate: say so instead of an IndexError deep inside. Its rows
    are the real tokens' positions (fairseq numbers them past the padding), so a batch padded wider than
    the table fits where every row's tokens do; they are counted only then (a device sync). With
    `padding_idx` None (a decoding step, which fairseq numbers by the prefix's width) the width counts."""
    if not isinstance(embed_positions, LearnedPositionalEmbedding) or tokens.size(1) <= limit:
        return
    length = tokens.size(1) if padding_idx is None else int(tokens.ne(padding_idx).sum(dim=1).max())
    if length > limit:
        raise ValueError(f"input of {length} tokens exceeds the learned position table ({limit} positions); "
                         "use --input-positions none/sinusoidal, or a model built with a larger maximum "
                         "(--max-source-positions / --max-target-positions; RoBERTa: --max-positions)")


FULLY_SHARDED_MESSAGE = (
    "posenc_fairseq does not support --ddp-backend fully_sharded: FSDP flattens the parameters of the "
    "positional encoding that every layer shares, and the encodings' per-forward terms and kept tables are "
    "computed from those parameters. Use --ddp-backend pytorch_ddp (c10d, the default on GPUs) or legacy_ddp, "
    "with --checkpoint-activations (and --offload-activations) to save memory")


def refuse_unsupported(args):
    """Training set-ups that the encodings do not support: refused when the model is built."""
    if getattr(args, "ddp_backend", None) == "fully_sharded":
        raise ValueError(FULLY_SHARDED_MESSAGE)


def checkpointing(args) -> tuple:
    """(checkpoint, offload) that --checkpoint-activations / --offload-activations ask for, and a copy
    of `args` for fairseq's layer builders with both off: our stacks checkpoint their layers
    themselves, non-reentrant (layer_checkpoint.py), instead of fairseq's reentrant wrapper."""
    offload = bool(getattr(args, "offload_activations", False))
    wanted = offload or bool(getattr(args, "checkpoint_activations", False))
    plain = copy.copy(args)
    plain.checkpoint_activations = plain.offload_activations = False
    return wanted, offload, plain


def reads_token_positions(encoding) -> bool:
    """Whether `encoding` (each part of a `PerStackEncoding`) reads the target token positions of a
    call: through its projection hooks (rotary, FLOATER) or its own `begin`. The relative hooks get
    the positions from the attention instead."""
    return any(hook_use(part).projects or overrides(type(part), ("begin",)) for part in encoding_parts(encoding))


class EncodingOfStack:
    """The model's encoding as a stack holds it: a plain object, not a submodule, because the model
    owns (and saves) the encoding once. Each stack starts its forward passes through it."""
    __slots__ = ("encoding",)

    def __init__(self, encoding=None):
        self.encoding = encoding


class PositionalStack:
    """What the encoder and decoder stacks share: the encoding they tell the positions (`encoding`,
    set by `attach_encoding`; None: not attached)."""
    held: EncodingOfStack

    @property
    def encoding(self):
        return self.held.encoding


def every_layer(layers) -> list:
    """A stack's layers, all of them in order: under --encoder/decoder-layerdrop fairseq's
    `LayerDropModuleList` skips layers at random when iterated in training mode (a model is built
    in training mode), so iterating it would bind a random subset at shifted indices."""
    return [layers[index] for index in range(len(layers))]


class PositionalTransformerEncoder(PositionalStack, TransformerEncoder):
    """fairseq's encoder with PositionalAttention; tells the encoding the source positions."""

    def __init__(self, args, dictionary, embed_tokens, return_fc=False):
        refuse_unsupported(args)
        super().__init__(args, dictionary, embed_tokens, return_fc=return_fc)
        use_positional_attention(self)
        # stock's name, so that --retain-dropout-modules TransformerEncoder matches as in stock
        self.dropout_module.module_name = TransformerEncoder.__name__
        self.held = EncodingOfStack()

    def build_encoder_layer(self, args):
        wanted, offload, plain = checkpointing(args)
        layer = super().build_encoder_layer(plain)
        return checkpoint_layer(layer, offload) if wanted else layer

    def bind_encoding(self, encoding):
        self.held.encoding = encoding
        for index, layer in enumerate(every_layer(self.layers)):
            layer.self_attn.bind_position(encoding, "encoder", index)

    def forward(self, src_tokens, *args, **kwargs):
        check_length(self.embed_positions, src_tokens, self.padding_idx, self.max_source_positions)
        if self.encoding is not None:
            self.encoding.begin("encoder", token_positions(src_tokens, self.padding_idx))
        out = super().forward(src_tokens, *args, **kwargs)
        if self.encoding is not None:
            self.encoding.end("encoder")
        return out


class PositionalTransformerDecoder(PositionalStack, TransformerDecoder):
    """fairseq's decoder with PositionalAttention; tells the encoding the target positions of
    this call (the current step during incremental decoding) and the source positions."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        refuse_unsupported(args)
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        use_positional_attention(self)
        self.dropout_module.module_name = TransformerDecoder.__name__  # as stock (--retain-dropout-modules)
        self.held = EncodingOfStack()

    def build_decoder_layer(self, args, no_encoder_attn=False):
        wanted, offload, plain = checkpointing(args)
        layer = super().build_decoder_layer(plain, no_encoder_attn=no_encoder_attn)
        return checkpoint_layer(layer, offload) if wanted else layer

    def bind_encoding(self, encoding):
        self.held.encoding = encoding
        for index, layer in enumerate(every_layer(self.layers)):
            layer.self_attn.bind_position(encoding, "decoder", index)
            if layer.encoder_attn is not None:
                layer.encoder_attn.bind_position(encoding, "cross", index)

    def buffered_future_mask(self, tensor):
        """fairseq's future mask of this pass's self-attention, named in the pass context (the
        attention then knows it blocks exactly the future without reading it)."""
        mask = super().buffered_future_mask(tensor)
        if self.encoding is not None:
            for part in encoding_parts(self.encoding):
                context = part.contexts.get("decoder")
                if context is not None:
                    context.future_mask = mask
        return mask

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        check_length(self.embed_positions, prev_output_tokens,
                     self.padding_idx if incremental_state is None else None, self.max_target_positions)
        if self.encoding is not None:
            earlier = 0
            if incremental_state is None:
                positions = token_positions(prev_output_tokens, self.padding_idx)
            else:
                earlier = prev_output_tokens.size(1) - 1
                if not reads_token_positions(self.encoding):  # (a step's positions cost a device sync)
                    positions = None
                elif prev_output_tokens.eq(self.padding_idx).any():  # (fairseq's decoder asks the same each step)
                    positions = tensor_of(token_positions(prev_output_tokens, self.padding_idx))[:, -1:]
                else:  # no padding: this step's token is at `earlier` in every row
                    positions = shared_range(prev_output_tokens.size(0), earlier, earlier + 1, prev_output_tokens.device)
            source = None  # (a later decoding step keeps the first step's: cross-attention keys are cached)
            if earlier == 0 and encoder_out is not None:
                if len(encoder_out.get("encoder_padding_mask", [])) > 0:
                    source = real_token_positions(~encoder_out["encoder_padding_mask"][0])
                elif len(encoder_out.get("encoder_out", [])) > 0:
                    length, batch = encoder_out["encoder_out"][0].shape[:2]
                    source = shared_range(batch, 0, length, prev_output_tokens.device)
            self.encoding.begin("decoder", positions, source, earlier)
        out = super().extract_features(prev_output_tokens, encoder_out, incremental_state, **kwargs)
        if self.encoding is not None:
            self.encoding.end("decoder")
        return out


def encoding_parts(encoding) -> list:
    """The encodings that serve attention layers: the parts of a `PerStackEncoding`, else `encoding`."""
    return encoding.parts() if isinstance(encoding, PerStackEncoding) else [encoding]


class PerStackEncoding(nn.Module):
    """The model's encoding when the encoder and decoder differ in embedding size or head count:
    one part sized by each stack (the encoder part serves the encoder's self-attention, the decoder
    part the decoder's self- and cross-attention, whose projections have the decoder's size). Each
    part is an ordinary encoding of the chosen class; the stacks talk to this module as to one
    encoding. State-dict keys: `positional_encoding.{encoder,decoder}.*`."""

    def __init__(self, encoder_part, decoder_part):
        super().__init__()
        self.encoder, self.decoder = encoder_part, decoder_part
        self.name = encoder_part.name
        self.default_input_positions = encoder_part.default_input_positions
        self.starts_as_identity = encoder_part.starts_as_identity

    def parts(self):
        return [self.encoder, self.decoder]

    def for_role(self, role: str):
        return self.encoder if role == "encoder" else self.decoder

    def begin(self, stack, positions=None, source_positions=None, earlier=0):
        for part in self.parts():
            part.begin(stack, positions, source_positions, earlier)

    def end(self, stack):
        for part in self.parts():
            part.end(stack)

    def bind_model(self, model, attentions):
        # each part serves the attentions of its roles (`for_role`); a part may freeze everything
        # outside itself (FLOATER's --floater-train-dynamics-only): each part's choice for its own
        # parameters stands
        own = [(parameter, parameter.requires_grad) for parameter in self.parameters()]
        for part in self.parts():
            if hasattr(part, "bind_model"):
                part.bind_model(model, [entry for entry in attentions if self.for_role(entry[0]) is part])
        for parameter, trainable in own:
            parameter.requires_grad_(trainable)

    def reset_to_identity(self):
        for part in self.parts():
            part.reset_to_identity()


@contextlib.contextmanager
def own_random_stream():
    """Random draws inside come from the CPU generator seeded by a hash of its state, which is restored
    after: the encoding's initial values still follow the seed, and every draw after (a classification
    head, sampling in fairseq-generate) is the one stock fairseq makes with the same seed, so a converted
    checkpoint samples as its source."""
    seed = int.from_bytes(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()[:8], "little") >> 1
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # (the CPU one only: models are built on the CPU)
        yield


def attach_encoding(model, args, encoder_stack=None, decoder_stack=None):
    """Build the model's one encoding (in its own random stream) and bind every attention layer of its
    stacks to it (an encoder-decoder, RoBERTa's encoder alone, a language model's decoder alone). Encoder
    and decoder of different embedding sizes or head counts get a `PerStackEncoding` (each part sized by
    its stack)."""
    with own_random_stream():
        return _attach_encoding(model, args, encoder_stack, decoder_stack)


def warn_of_other_encodings_options(args):
    """A logged warning for each option of another encoding that `args` sets (--floater-method on a t5
    model): fairseq accepts it, since every model has every encoding's options, but it changes nothing.
    A warning, not a refusal: checkpoints trained with such options before must still load."""
    for option, owners in options_of_other_encodings(args.positional_encoding, args).items():
        logging.getLogger(__name__).warning(
            f"{option} is an option of {'/'.join(owners)}; this model's encoding, {args.positional_encoding}, "
            "does not read it: it has no effect")


def _attach_encoding(model, args, encoder_stack, decoder_stack):
    warn_of_other_encodings_options(args)
    stacks = {role: stack for role, stack in (("encoder", encoder_stack), ("decoder", decoder_stack))
              if stack is not None}
    layers = {role: getattr(args, f"{role}_layers") if role in stacks else 0 for role in ("encoder", "decoder")}
    sizes = {role: (getattr(args, f"{role}_embed_dim"), getattr(args, f"{role}_attention_heads")) for role in stacks}
    if len(set(sizes.values())) == 1:
        embed_dim, heads = next(iter(sizes.values()))
        encoding = build_encoding(args.positional_encoding, args, ModelDims(
            embed_dim=embed_dim, heads=heads, encoder_layers=layers["encoder"], decoder_layers=layers["decoder"]))
        parts = {role: encoding for role in stacks}
    else:  # (the encoder's part built first, then the decoder's: the order of their random draws)
        parts = {role: build_encoding(args.positional_encoding, args, ModelDims(
            embed_dim=sizes[role][0], heads=sizes[role][1], encoder_layers=layers["encoder"] if role == "encoder" else 0,
            decoder_layers=layers["decoder"] if role == "decoder" else 0)) for role in stacks}
        encoding = PerStackEncoding(parts["encoder"], parts["decoder"])
    model.positional_encoding = encoding
    model.stock_input_kept = keeps_stock_input(args)
    take_allow_encoding_change(model, args)
    for role, stack in stacks.items():
        stack.bind_encoding(parts[role])
        stack.held.encoding = encoding  # begin() reaches every part
    if hasattr(encoding, "bind_model"):  # (an encoding that keeps state of the attention layers)
        encoding.bind_model(model, bound_attentions(model))
    return encoding


def register_architectures(model_name: str, prefix: str, sizes: dict):
    """Register `{prefix}_{encoding}{size suffix}` for every encoding and size: the encoding's
    defaults first, then fairseq's own size architecture fills in everything else."""

    def register(encoding, suffix, size_architecture):
        def architecture(args):
            set_position_defaults(args, encoding, STACKS[model_name])
            size_architecture(args)

        register_model_architecture(model_name, f"{prefix}_{encoding}{suffix}")(architecture)

    for encoding in ENCODINGS:
        for suffix, size_architecture in sizes.items():
            register(encoding, suffix, size_architecture)
