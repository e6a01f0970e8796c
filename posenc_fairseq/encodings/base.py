"""The small interface between an encoding and `PositionalAttention`, and the registry.

An encoding is one `nn.Module` per model, shared by every attention layer (x-transformers
style). Layers call it with their role ('encoder' self-attention, 'decoder' self-attention,
'cross' attention) and 0-based layer index; every hook has a default that adds nothing, so an
encoding overrides only where its position information enters. Four hooks:

    projection_bias, project    per token: the q/k/v projections' bias, a change of q/k/v (FLOATER, rotary)
    distance_term, value_term   per key - query distance of a self-attention call: the logit term
                                and a term on the values, as a `DistanceTerm` (distance.py, which
                                makes of it what each kernel reads)

Values an encoding computes from positions and parameters go to its `cache` (cache.py). This file does not import
fairseq: encodings are plain torch and testable in milliseconds.
"""
import argparse
import difflib
import logging
import threading
from typing import Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional

import torch
from torch import Tensor, nn

from . import trained_with
from .cache import EncodingCache, KeptValues, TermKey
from ..switches import flex_attention_mode, triton_attention_mode
from .distance import DistanceTerm
from .option_types import OptionValueError, flag_name, given, option
from .positions import AnyPositions

ROLES = ("encoder", "decoder", "cross")


class PassContext:
    """What a stack tells the attention layers it runs in one forward pass, made by `begin`:

    stack        'encoder' or 'decoder' (whose layers serve the roles 'decoder' and 'cross')
    positions    the (B, T) positions of the stack's tokens in this call (a `shared_range` where
                 every row is alike); None where nothing reads them
    source       decoder: the positions of the source tokens (the cross-attention keys)
    earlier      target tokens before this call's (incremental decoding: the cached steps)
    flex_mode    POSENC_FLEX_ATTENTION when the pass started (kernels/flex.py)
    triton_mode  POSENC_TRITON_ATTENTION when the pass started (kernels/triton_attention.py)
    future_mask  the self-attention mask the decoder stack made last in this pass (fairseq's
                 future mask, `buffered_future_mask`, made before each layer), None until it
                 does: a call given that very mask knows it blocks exactly the future without
                 reading it (any other mask, e.g. in a layer's recomputation, is read)

    Plain attributes: made once per decoding step, where nn.Module or a dataclass would cost."""
    __slots__ = ("stack", "positions", "source", "earlier", "flex_mode", "triton_mode", "future_mask")

    def __init__(self, stack: str, positions: Optional[AnyPositions], source: Optional[AnyPositions], earlier: int,
                 flex_mode: str, triton_mode: str = "off"):
        self.stack, self.positions, self.source, self.earlier = stack, positions, source, earlier
        self.flex_mode, self.triton_mode, self.future_mask = flex_mode, triton_mode, None

    def key_positions(self, role: str) -> Optional[AnyPositions]:
        """The positions of the keys of an attention in `role` ('cross': the source tokens; the
        queries are always the stack's own `positions`)."""
        return self.source if role == "cross" else self.positions


class ThreadState(threading.local):
    """What an encoding keeps of the passes in progress, one per thread: its stacks' pass contexts and
    its cache: threads that run one model at once (a threaded server, DataParallel's replicas, which
    share this object) each see their own passes, and a stack's `begin` in one thread leaves another's
    positions alone. The caches share their inference scope
    (`kept`, cache.py): a thread's first pass reads what the others computed (FLOATER's table), as one
    thread's later passes do. Copies and pickles start empty (fairseq's EMA deep-copies the model)."""

    def __init__(self, kept: KeptValues):
        # the pass context of each stack ('encoder', 'decoder'): made by its `begin`, read by the
        # attention layers the stack runs in that pass
        self.contexts: Dict[str, PassContext] = {}
        self.cache = EncodingCache(kept)

    def __reduce__(self):
        return ThreadState, (KeptValues(),)


class PositionalEncoding(nn.Module):
    """Base class: no position information at all (every hook is neutral)."""

    #: absolute input embedding this encoding uses by default ('none', 'sinusoidal', 'learned')
    default_input_positions = "sinusoidal"
    #: whether `reset_to_identity` can make it add nothing (warm start from stock checkpoints)
    starts_as_identity = True

    def __init__(self, args: argparse.Namespace, dims: "ModelDims"):
        super().__init__()
        self.dims = dims
        self.thread_state = ThreadState(KeptValues())
        # a model's absolute input embedding, which its weights were trained with: `set_position_defaults`
        # records in input_positions_default the choice it made where none was given
        choice = given(args, "input_positions")
        if choice is not None:
            self.record_option("input_positions", choice, was_given=given(args, "input_positions_default") != choice)

    def __setstate__(self, state):
        # a whole model pickled before ThreadState held its contexts and cache as attributes
        state = {key: value for key, value in state.items() if key not in ("contexts", "cache")}
        state.setdefault("thread_state", ThreadState(KeptValues()))
        super().__setstate__(state)

    @property
    def contexts(self) -> Dict[str, PassContext]:
        """This thread's pass context of each stack ('encoder', 'decoder')."""
        return self.thread_state.contexts

    @contexts.setter
    def contexts(self, contexts: Dict[str, PassContext]):
        self.thread_state.contexts = contexts

    @property
    def cache(self) -> EncodingCache:
        """This thread's cache (cache.py)."""
        return self.thread_state.cache

    @staticmethod
    def add_args(parser: argparse.ArgumentParser):
        """Command-line options of this encoding (names prefixed with the encoding name)."""

    def defining_option(self, args, dest: str, checker, default, read=option, follows=()):
        """`read(args, dest, checker, default)` (option_types' `option` or `option_pair`) of an option
        that defines what this encoding computes: kept, with whether `args` gave it, in the entry its
        weights are saved with (trained_with.py). `follows`: the options a computed `default` follows
        (given with another value than the weights were trained with, it counts as given too). May be
        called before `__init__` (a plain dict)."""
        value = read(args, dest, checker, default)
        self.record_option(dest, value, given(args, dest) is not None, follows)
        return value

    def not_read(self, args, dest: str, why: str) -> None:
        """A logged warning where `args` gives option `dest`, which this encoding, as built, does not read
        (`why`): fairseq accepts it (every model has every encoding's options), and it changes nothing.
        A warning, not a refusal: checkpoints trained so must still load."""
        if given(args, dest) not in (None, False):
            logging.getLogger(__name__).warning(f"{flag_name(dest)} has no effect: {why}")

    def record_option(self, dest: str, value, was_given: bool, follows=()) -> None:
        """Keep `value` of option `dest` (the value computed with, where it is not the one read) in the
        entry, with whether the config gave it."""
        self.defining_options[dest] = trained_with.DefiningOption(value, was_given, tuple(follows))

    @property
    def defining_options(self) -> Dict[str, "trained_with.DefiningOption"]:
        return vars(self).setdefault("_defining_options", {})

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + trained_with.KEY] = trained_with.entry(self.name, self.defining_options)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # (checked by the model's load_state_dict, before any weight is copied: torch passes strict=True
        # here whatever the load was given, and only the model knows its config)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + trained_with.KEY in unexpected_keys:  # (not a parameter)
            unexpected_keys.remove(prefix + trained_with.KEY)

    def check_trained_with(self, saved, loadable: bool = True) -> None:
        """Refuse the saved entry (`trained_with.check`) of weights trained with another encoding, or
        with another value of an option this encoding has by default (`loadable`: whether the weights
        fit this encoding's by name and shape)."""
        trained_with.check(saved, self.name, self.defining_options, loadable)

    @classmethod
    def depth_changed_by_pruning(cls, args, role: str, kept: List[int]) -> Optional[str]:
        """What LayerDrop pruning to the `role` stack's layers `kept` (sorted, 0-based) would change
        that this encoding (with options `args`) defines by a layer's depth rather than by its
        parameters, else None. The pruned model would not be the trained one with layers removed."""
        return None

    # --- called by the stacks -------------------------------------------------------------
    def begin(self, stack: str, positions: Optional[AnyPositions] = None,
              source_positions: Optional[AnyPositions] = None, earlier: int = 0) -> "PassContext":
        """A stack ('encoder' or 'decoder') starts a forward pass: its `PassContext` (`positions`:
        its tokens' positions; `source_positions`: the decoder's source tokens, kept from the last
        pass that gave them; None: nothing reads them), and per-pass results are forgotten.
        `earlier`: target tokens before this call's (incremental decoding: the cached steps)."""
        previous = self.contexts.get(stack)
        self.cache.begin(stack, earlier, reads_encoder=stack == "decoder" and source_positions is not None)
        if source_positions is None and previous is not None:
            source_positions = previous.source
        context = self.contexts[stack] = PassContext(stack, positions, source_positions, earlier,
                                                    flex_attention_mode(), triton_attention_mode())
        return context

    def end(self, stack: str):
        """The stack's forward pass is over: its terms shared by the layers are dropped (`EncodingCache.end`)."""
        self.cache.end(stack)

    def kept_value_inputs(self) -> Iterable[Tensor]:
        """The tensors the values kept in the cache's inference scope are computed from (checked by
        value once per pass): the encoding's parameters."""
        return self.parameters()

    def term_key(self, role: str, what: str, *computed_from) -> TermKey:
        """The key of this encoding's term `what` of stack `role` for `memoize` and the inference
        scope; `computed_from`: the rest that tells its values apart (layer or table, distances,
        dtype; parameters aside)."""
        return TermKey(role, self.name, what, computed_from)

    def memoize(self, key: TermKey, compute: Callable[[], Tensor]) -> Tensor:
        """`EncodingCache.memoize`: a position-only term computed once per forward and shared across
        layers; its stack's `end` (or `key.role`'s next `begin`) drops it."""
        return self.cache.memoize(key, compute)

    def recorded(self, function: Callable) -> Callable:
        """`EncodingCache.recorded`: `function` for non-reentrant activation checkpointing; its
        recomputation also sees the stacks' contexts (positions) and the cache of its forward, not a
        later pass's, in whichever thread it runs (autograd runs a CUDA backward in a thread of its own)."""
        forward_cache, forward_contexts = self.cache, []

        def in_forward_contexts(*args, **kwargs):
            replay, state = bool(forward_contexts), self.thread_state
            if replay:
                current = state.cache, state.contexts
                state.cache, state.contexts = forward_cache, dict(forward_contexts[0])
            try:
                return function(*args, **kwargs)
            finally:
                if replay:
                    state.cache, state.contexts = current
                else:
                    forward_contexts.append(dict(state.contexts))
        return forward_cache.recorded(in_forward_contexts)

    def in_recorded_run(self) -> bool:
        return self.cache.in_recorded_run()

    # --- the hooks, called by PositionalAttention -----------------------------------------
    def project(self, role: str, layer: int, which: str, x: Tensor, positions: Optional[AnyPositions]) -> Tensor:
        """Projected q/k/v (T, B, E) of tokens at absolute `positions` (B, T) -> same shape.
        `positions`: the stack's `PassContext` positions as given (a `shared_range` where every row
        is alike), or a tensor of arbitrary positions."""
        return x

    def projection_bias(self, role: str, layer: int, which: str,
                        positions: Optional[AnyPositions]) -> Optional[Tensor]:
        """The bias of each token's q/k/v projection (T, B, E), (T, 1, E) shared by the batch or
        (E,) for every token alike, used in place of the projection's own bias (FLOATER: b(t_i));
        None keeps the projection as it is. Positions are (B, T)."""
        return None

    def distance_term(self, role: str, layer: int, low: int, high: int, queries: int,
                      dtype: torch.dtype) -> Optional[DistanceTerm]:
        """The logit term of a self-attention call of `queries` queries whose key - query distances
        are low..high, as values per distance (`DistanceTerm`, distance.py); None where the layer has
        none. `dtype`: the queries' (a term may keep its parameters' dtype: the attention casts what
        it adds). The attention makes of it what its kernel reads (the dense (B, H, Tq, Tk)
        term, a block's slice, a decoding step's row, FlexAttention's table)."""
        return None

    def value_term(self, role: str, layer: int, low: int, high: int, queries: int,
                   dtype: torch.dtype) -> Optional[DistanceTerm]:
        """A term added to the attention output, sum_j p_ij vectors[row of j - i] (`DistanceTerm`
        with `vectors` and `rows`); None where the layer has none."""
        return None

    # --- warm start ------------------------------------------------------------------------
    def reset_to_identity(self):
        """Initialise so that the encoding adds nothing (used when converting stock checkpoints)."""


#: the hooks through which an encoding changes the projected q, k, v
PROJECTION_HOOKS = ("projection_bias", "project")
#: the hooks through which an encoding adds relative terms to self-attention
RELATIVE_HOOKS = ("distance_term", "value_term")
_HOOKS = frozenset(PROJECTION_HOOKS + RELATIVE_HOOKS)
_CLASS_HOOK_USE: Dict[type, "HookUse"] = {}


class HookUse(NamedTuple):
    """Which kinds of hooks an encoding has its own version of (`hook_use`)."""
    projects: bool  # a PROJECTION_HOOKS hook
    logits: bool  # distance_term
    values: bool  # value_term


def overrides(kind: type, hooks) -> bool:
    """Whether the class `kind` has its own version of any of `hooks` (not the neutral default)."""
    return any(getattr(kind, name) is not getattr(PositionalEncoding, name) for name in hooks)


def hook_use(encoding: PositionalEncoding) -> HookUse:
    """Which hooks `encoding` has its own version of (its class's, or one set on the object): the
    attention asks only those; the neutral defaults add nothing. Decided once per class."""
    kind = type(encoding)
    use = _CLASS_HOOK_USE.get(kind)
    if use is None:
        use = _CLASS_HOOK_USE[kind] = HookUse(overrides(kind, PROJECTION_HOOKS), overrides(kind, ("distance_term",)),
                                              overrides(kind, ("value_term",)))
    own = encoding.__dict__
    if own.keys() & _HOOKS:  # (looks up the few hook names: the object's dict may hold dozens of attributes)
        use = HookUse(use.projects or any(name in own for name in PROJECTION_HOOKS),
                      use.logits or "distance_term" in own, use.values or "value_term" in own)
    return use


class ModelDims:
    """What an encoding needs to know about the model it serves."""

    def __init__(self, embed_dim: int, heads: int, encoder_layers: int, decoder_layers: int = 0):
        self.embed_dim, self.heads = embed_dim, heads
        self.encoder_layers, self.decoder_layers = encoder_layers, decoder_layers
        self.head_dim = embed_dim // heads

    def layers(self, role: str) -> int:
        return self.encoder_layers if role == "encoder" else self.decoder_layers


ENCODINGS: Dict[str, type] = {}


def register_encoding(name: str):
    """Class decorator: make an encoding available as `--positional-encoding NAME` and as the
    architectures `transformer_NAME*` / `roberta_NAME*`."""

    def wrap(cls):
        if name in ENCODINGS:
            raise ValueError(f"positional encoding {name!r} registered twice")
        ENCODINGS[name] = cls
        cls.name = name
        return cls

    return wrap


def encoding_class(name: str) -> type:
    """The encoding registered as `name` (--positional-encoding); another name is refused. (argparse
    checks the command line; a stored config, an override or code building a model, here.)"""
    if name not in ENCODINGS:
        raise OptionValueError(f"--positional-encoding {name}: expected one of {', '.join(sorted(ENCODINGS))}")
    return ENCODINGS[name]


def build_encoding(name: str, args, dims: ModelDims) -> PositionalEncoding:
    cls = encoding_class(name)
    refuse_unknown_options(args)
    return cls(args, dims)


def options_of(name: str) -> dict:
    """{dest: argparse default} of the options encoding `name` reads: those its add_args adds."""
    parser = argparse.ArgumentParser(add_help=False)
    ENCODINGS[name].add_args(parser)
    return {action.dest: action.default for action in parser._actions}


def encoding_option_names() -> FrozenSet[str]:
    """The dests of every registered encoding's options (read from their `add_args`, once per model built)."""
    return frozenset().union(*(options_of(name) for name in ENCODINGS))


#: the package's model options besides the encodings' (models/common.add_position_args), and the
#: beginnings that a misspelling of one keeps
GENERAL_OPTIONS = frozenset({"positional_encoding", "input_positions", "input_positions_default",
                             "input_positions_flags", "allow_encoding_change"})
GENERAL_PREFIXES = ("positional_enc", "input_pos", "allow_enc")


def refuse_unknown_options(args) -> None:
    """Refuse (OptionValueError, one line) a name in the model's config (Namespace, dict or DictConfig)
    that begins as the options of an encoding (or the scalar-bias family) or the package's general
    options do but is none of them. fairseq's --model-overrides, hub keyword arguments and arg_overrides
    set any name they are given, so a misspelt option would be ignored silently (argparse refuses one on
    the command line). Every option this package ever had is still registered: a stored config holds no
    other."""
    known = encoding_option_names() | GENERAL_OPTIONS
    prefixes = GENERAL_PREFIXES + tuple(prefix for prefix in (f"{name}_" for name in (*ENCODINGS, "scalar_bias"))
                                        if any(dest.startswith(prefix) for dest in known))
    for name in list(args.keys() if hasattr(args, "keys") else vars(args).keys()):
        unknown = isinstance(name, str) and name.startswith(prefixes) and name not in known
        if unknown and given(args, name) is not None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {flag_name(close[0])}?)" if close else ""
            raise OptionValueError(f"{flag_name(name)}: no encoding has this option{hint}; a name given to "
                                   "--model-overrides, from_pretrained or arg_overrides must be one")


# Baselines whose position information is only the absolute input embedding (fairseq's own).
@register_encoding("sinusoidal")
class Sinusoidal(PositionalEncoding):
    default_input_positions = "sinusoidal"


@register_encoding("learned")
class Learned(PositionalEncoding):
    default_input_positions = "learned"


@register_encoding("nope")
class NoPositions(PositionalEncoding):
    default_input_positions = "none"
