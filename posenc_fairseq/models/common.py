"""What the translation and RoBERTa models share: options, stacks that tell the encoding the
token positions, and attaching one encoding to a model."""
import argparse
import contextlib
import copy
import hashlib
import logging
import re
from typing import Optional

import torch
from torch import Tensor, nn

from fairseq.models import register_model_architecture
from fairseq.models.transformer import TransformerDecoder, TransformerEncoder
from fairseq.modules import LearnedPositionalEmbedding

from ..attention import bound_attentions, use_positional_attention
from ..layer_checkpoint import checkpoint_layer
from ..encodings import ENCODINGS, ModelDims, build_encoding, options_of_other_encodings
from ..encodings import trained_with
from ..encodings.base import PositionalEncoding, encoding_class, hook_use, overrides
from ..encodings.option_types import OptionValueError, flag_name
from ..encodings.positions import AnyPositions, PaddedPositions, shared_range, tensor_of

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

    def begin(self, role, positions=None, source_positions=None, earlier=0):
        for part in self.parts():
            part.begin(role, positions, source_positions, earlier)

    def end(self, role):
        for part in self.parts():
            part.end(role)

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
    else:  # (the encoder's part first: the same random draws as before this option existed)
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


# --- LayerDrop pruning (--encoder-layers-to-keep / --decoder-layers-to-keep) ------------------------
_PER_LAYER = re.compile(r"^(encoder|decoder)(_?)(\d+)((?:_.*)?)$")


def _layers_to_keep(cfg, role):
    value = getattr(cfg, f"{role}_layers_to_keep", None) if cfg is not None else None
    return sorted(int(layer) for layer in str(value).split(",")) if value else None


def prune_encoding_state_dict(state_dict, model_cfg, prefix="positional_encoding."):
    """What fairseq's `checkpoint_utils.prune_state_dict` does to `*.layers.N.*`, done to the
    encoding's per-layer parameters: a key component `{role}{N}` / `{role}_{N}[_...]` (Shaw/LFHC
    tables, XL/GCDF projections, T5/AT5 per-layer sets) of a kept layer is renumbered to the layer's
    new index, one of a dropped layer is removed; every other encoding key is kept. FLOATER's table
    `cache` is laid out by layer and is dropped, so the loaded model solves it for its own layers.
    Same condition as fairseq's (a config with an arch and *_layers_to_keep), so that the encoding
    is renumbered exactly when the layers are. A pruning that would change what the encoding defines
    by a layer's depth (`depth_changed_by_pruning`: LFHC's l, a first-layer-only bias or FLOATER block)
    is refused. Returns a new dict."""
    if model_cfg is None:
        return state_dict
    arch = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    keep = {role: _layers_to_keep(model_cfg, role) for role in ("encoder", "decoder")}
    if arch is None or arch == "ptt_transformer" or not any(keep.values()):
        return state_dict
    encoding = ENCODINGS.get(getattr(model_cfg, "positional_encoding", None))
    for role, layers in keep.items():
        changed = encoding.depth_changed_by_pruning(model_cfg, role, layers) if encoding and layers else None
        if changed:
            raise OptionValueError(f"--{role}-layers-to-keep {','.join(map(str, layers))}: {changed}, a model it "
                                   "was not trained as; keep other layers")
    mapping = {role: {old: new for new, old in enumerate(layers)} for role, layers in keep.items() if layers}
    pruned = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            pruned[key] = value
            continue
        parts = key[len(prefix):].split(".")
        if parts[-1] == "cache":
            continue
        dropped = False
        for index, part in enumerate(parts):
            match = _PER_LAYER.match(part)
            if match and match.group(1) in mapping:
                role, sep, layer, rest = match.groups()
                if int(layer) not in mapping[role]:
                    dropped = True
                    break
                parts[index] = f"{role}{sep}{mapping[role][int(layer)]}{rest}"
        if not dropped:
            pruned[prefix + ".".join(parts)] = value
    return pruned


LEARNED_TABLE = "embed_positions.weight"
#: the option that sizes each stack's learned input table (its rows: that many positions + padding_idx + 1)
TABLE_SIZE_OPTION = {"encoder.sentence_encoder.": "max_positions", "encoder.": "max_source_positions",
                     "decoder.": "max_target_positions"}
#: the state-dict key that says the weights were trained or converted with the stock input embedding
STOCK_INPUT_KEPT = "positional_encoding.input_positions_stock"


def take_allow_encoding_change(model, args) -> None:
    """--allow-encoding-change, for the loads of this run (the model's `load_state_dict`): taken out of
    `args`, the config fairseq saves with the model, so that later loads of its checkpoints check."""
    model.allow_encoding_change = bool(getattr(args, "allow_encoding_change", None))
    if getattr(args, "allow_encoding_change", None) is not None:
        args.allow_encoding_change = None


def keeps_stock_input(args) -> bool:
    """Whether a model built from `args` keeps the base architecture's input embedding where its
    encoding would not (a converted checkpoint's relative encodings): its state dict says so."""
    return (args.input_positions == "stock"
            and ENCODINGS[args.positional_encoding].default_input_positions != "stock")


def check_stock_input_kept(state_dict, cfg) -> None:
    """Refuse weights that keep the stock input embedding (`STOCK_INPUT_KEPT`) for a model that
    dropped it by default: fairseq-train builds --restore-file's model from its command line, and a
    sinusoidal embedding keeps nothing in a checkpoint, so nothing else would tell. A choice given
    (--input-positions none, say) is taken as meant."""
    if STOCK_INPUT_KEPT not in state_dict or cfg is None or getattr(cfg, "input_positions", None) == "stock":
        return
    if getattr(cfg, "input_positions_default", None) == cfg.input_positions:
        raise OptionValueError(
            f"--input-positions {cfg.input_positions} (the encoding's default): the checkpoint's weights were "
            f"trained or converted with the stock input embedding; give --input-positions stock to keep it, "
            f"or --input-positions {cfg.input_positions} to drop it")


def check_learned_input_tables(model_state, state_dict, cfg) -> None:
    """Refuse, in one line naming the option, a checkpoint whose learned input position tables
    (fairseq's `STACK.embed_positions.weight`) are not where the model has them, or not of its size:
    a model built with another --input-positions than the checkpoint's (a converted checkpoint
    fine-tuned with --restore-file under the encoding's default, say), or with other maximum
    positions (fine-tuning on longer inputs), which fairseq's strict load reports only as an
    unexpected or missing key or torch's size mismatch. (A sinusoidal embedding keeps nothing in a
    checkpoint, so sinusoidal and none are not told apart here, as in stock fairseq.)"""
    ours = {key for key in model_state if key.endswith(LEARNED_TABLE)}
    theirs = {key for key in state_dict if key.endswith(LEARNED_TABLE)}
    choice = getattr(cfg, "input_positions", None)
    if theirs - ours:
        raise OptionValueError(
            f"--input-positions {choice}: the checkpoint has a learned input position table "
            f"({sorted(theirs - ours)[0]}) that this model has no place for; build the model with the "
            f"checkpoint's --input-positions (stock for a converted checkpoint, docs/conversion.md)")
    if ours - theirs:
        raise OptionValueError(
            f"--input-positions {choice}: the model has a learned input position table "
            f"({sorted(ours - theirs)[0]}) that the checkpoint lacks; build the model with the checkpoint's "
            f"--input-positions")
    for key in sorted(ours):
        extra_rows = state_dict[key].size(0) - model_state[key].size(0)
        if extra_rows != 0:
            raise learned_table_size_error(key, extra_rows, cfg)


def learned_table_size_error(key: str, extra_rows: int, cfg) -> OptionValueError:
    """The refusal of a checkpoint's learned table `key` that has `extra_rows` more rows (positions)
    than the model's: names the option that sizes it, with the value that would load it."""
    dest = TABLE_SIZE_OPTION.get(key[:-len(LEARNED_TABLE)])
    built = getattr(cfg, dest, None) if dest is not None else None
    if not isinstance(built, int):
        return OptionValueError(
            f"the checkpoint's learned input position table ({key}) holds {abs(extra_rows)} "
            f"{'more' if extra_rows > 0 else 'fewer'} positions than the model's; a learned table has a fixed size: "
            f"build the model with the checkpoint's maximum positions")
    option = flag_name(dest)
    default = " (by default --tokens-per-sample)" if dest == "max_target_positions" and \
        hasattr(cfg, "tokens_per_sample") and not hasattr(cfg, "max_source_positions") else ""
    return OptionValueError(
        f"{option} {built}{default}: the checkpoint's learned input position table ({key}) holds "
        f"{built + extra_rows} positions, this model's {built}; a learned table has a fixed size: give "
        f"{option} {built + extra_rows}, for inputs of at most {built + extra_rows} tokens")


def check_encoding_entries(model, state_dict, loadable: bool = True) -> None:
    """Refuse weights whose encoding entry (encodings/trained_with.py) says they were trained with
    another encoding, or with another value of an option the model's encoding has by default: every
    encoding module of `model` (a `PerStackEncoding`'s two parts) checks its own. `loadable`: whether
    the encoding's weights fit the model's (else --allow-encoding-change is no way out)."""
    for name, module in model.named_modules():
        saved = state_dict.get(f"{name}.{trained_with.KEY}") if isinstance(module, PositionalEncoding) else None
        if saved is not None:
            module.check_trained_with(saved, loadable)


def encoding_prefixes(model) -> tuple:
    """The state-dict prefixes of `model`'s encoding modules."""
    return tuple(f"{name}." for name, module in model.named_modules() if name and isinstance(module, PositionalEncoding))


def encoding_weights_fit(model, model_state, state_dict) -> bool:
    """Whether the checkpoint's encoding weights can be loaded into the model's as they are, as far as
    known before the load: no weight both hold in other shapes, and not weights on one side only. (Key
    names alone do not tell: an encoding renames older keys and takes extra state as it loads.)"""
    prefixes = encoding_prefixes(model)

    def weights(state):
        return {key: value for key, value in state.items() if key.startswith(prefixes) and key != STOCK_INPUT_KEPT
                and not key.endswith(f".{trained_with.KEY}")}
    ours, theirs = weights(model_state), weights(state_dict)
    if bool(ours) != bool(theirs):
        return False
    return all(ours[key].shape == theirs[key].shape for key in set(ours) & set(theirs) if torch.is_tensor(ours[key]))


def encoding_load_error(model, error: RuntimeError, state_dict, stock_converter: str) -> Optional[str]:
    """torch's strict-load `error` in one line where every key it names is an encoding's (None where it
    names another: that error stays torch's): a stock checkpoint not converted (`stock_converter`), or an
    encoding option that sizes the tables (--t5-num-buckets, --shaw-k, ...) other than the weights had."""
    prefixes, lines = encoding_prefixes(model), str(error).split("\n")
    missing = [key for line in lines if "Missing key(s) in state_dict:" in line for key in re.findall(r'"([^"]+)"', line)]
    unexpected = [key for line in lines if "Unexpected key(s) in state_dict:" in line
                  for key in re.findall(r'"([^"]+)"', line)]
    resized = re.findall(r"size mismatch for ([^:]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                         r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)", str(error))
    named = missing + unexpected + [key for key, _, _ in resized]
    if not named or not prefixes or not all(key.startswith(prefixes) for key in named):
        return None
    entries = [key for key in state_dict if key.endswith(f".{trained_with.KEY}")]
    if not entries and not any(key.startswith(prefixes) for key in state_dict):
        return (f"the checkpoint has none of this model's positional-encoding weights ({missing[0]}, ...): a "
                f"stock fairseq checkpoint is converted first ({stock_converter}, docs/conversion.md)")
    differences = ([f"{key} missing" for key in missing] + [f"{key} unexpected" for key in unexpected]
                   + [f"{key} of shape {theirs} in the checkpoint, {ours} here" for key, theirs, ours in resized])
    trained = [trained_with.described(state_dict[key]) for key in entries]
    return (f"the checkpoint's positional-encoding weights do not fit this model's ({'; '.join(differences[:3])}"
            f"{'; ...' if len(differences) > 3 else ''}): build the model with the encoding options the weights "
            f"were trained with{' (' + '; '.join(trained) + ')' if trained else ''}")


class EncodingStateMixin:
    """Model mixin for state dicts: per-layer encoding parameters follow their layer under LayerDrop
    pruning; learned input tables that the model and checkpoint disagree on are refused, and so are
    weights that keep the stock input embedding for a model that dropped it by default, and weights
    trained with another encoding or option value than the model's default (`check_encoding_entries`,
    unless --allow-encoding-change), and encoding weights of other names or shapes, named where the load fails (`encoding_load_error`)."""

    #: the script that converts the stock checkpoints of this kind of model (named in refusals)
    stock_converter = "scripts/convert_transformer_checkpoint.py"

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        cfg = model_cfg if model_cfg is not None else args
        # fairseq's renaming of older keys first (RoBERTa's decoder.sentence_encoder.*, as the released
        # model.pt name them), which its own load_state_dict does again below (a no-op then): the checks
        # read the keys as this model names them
        self.upgrade_state_dict(state_dict)
        state_dict = prune_encoding_state_dict(state_dict, cfg)
        if strict:
            model_state = self.state_dict()
            check_stock_input_kept(state_dict, cfg)
            check_learned_input_tables(model_state, state_dict, cfg)
            if not getattr(self, "allow_encoding_change", False):
                check_encoding_entries(self, state_dict, encoding_weights_fit(self, model_state, state_dict))
        state_dict = {key: value for key, value in state_dict.items() if key != STOCK_INPUT_KEPT}
        try:
            return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        except RuntimeError as error:  # (torch's missing/unexpected keys or size mismatch)
            told = encoding_load_error(self, error, state_dict, self.stock_converter) if strict else None
            if told is None:
                raise
            raise OptionValueError(told) from error

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(self, "stock_input_kept", False):
            destination[prefix + STOCK_INPUT_KEPT] = torch.ones(1)


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
