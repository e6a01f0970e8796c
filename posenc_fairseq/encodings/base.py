"""The small interface between an encoding and `PositionalAttention`, and the registry.

An encoding is one `nn.Module` per model, shared by every attention layer (x-transformers
style). Layers call it with their role ('encoder' self-attention, 'decoder' self-attention,
'cross' attention) and 0-based layer index; every hook has a default that adds nothing, so an
encoding overrides only where its position information enters. The query and key positions of
the relative hooks are 1-D: `Positions` from the attention (consecutive, bounds known; the values
are `.tensor`), or any tensor of positions (`AnyPositions`; `positions.tensor_of` reads either).
Values an encoding computes from positions and parameters go to its `cache` (cache.py). This file does not import
fairseq: encodings are plain torch and testable in milliseconds.
"""
import argparse
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .cache import EncodingCache
from .positions import AnyPositions, Positions, bounds, tensor_of

ROLES = ("encoder", "decoder", "cross")


class StepTerms(NamedTuple):
    """One query's position terms (a decoding step) as additions to the attention's inputs, which
    then make plain (fused) attention:

        softmax_j((q + query) . (k_j + keys_j) + logits_j) . (v_j + values_j)

    `query` broadcasts against (B, H, 1, D) (e.g. (H, 1, D)); `keys`/`values` against (B, H, Tk, D)
    ((Tk, D) shared by the heads, or (H, Tk, D)); `logits` against (B, H, 1, Tk) (e.g. (H, 1, Tk));
    None: nothing there. q arrives scaled by 1/sqrt(D)."""
    query: Optional[Tensor] = None
    keys: Optional[Tensor] = None
    values: Optional[Tensor] = None
    logits: Optional[Tensor] = None


class DistanceLogits(NamedTuple):
    """The logit terms of one call as a fused kernel reads them (`distance_logits`,
    flex_attention.py): for query i and key j of consecutive positions, c = j - i + Tq - 1 numbers
    the Tq + Tk - 1 distances key - query in ascending order, and the term of (b, h, i, j) is

        table[b, h, i, column[c]]  (+ key_bias[b, h, j])

    `table` (B or 1, H, Tq or 1, R): a size-1 batch or query dimension is shared (read at 0);
    `column` (Tq + Tk - 1,) long, the table column of each distance; None: column c itself;
    `key_bias` (B, H, Tk): a term of the key alone (XL/GCDF's u.k_j), or None."""
    table: Tensor
    column: Optional[Tensor] = None
    key_bias: Optional[Tensor] = None


def distance_range(query_positions: AnyPositions, key_positions: AnyPositions) -> Tuple[int, int]:
    """(lowest, highest) key - query distance of the pairs of 1-D positions (no device sync for a
    `position_range`); for consecutive positions the distances `DistanceLogits` numbers."""
    (q_low, q_high), (k_low, k_high) = bounds(query_positions), bounds(key_positions)
    return k_low - q_high, k_high - q_low


class PositionalEncoding(nn.Module):
    """Base class: no position information at all (every hook is neutral)."""

    #: absolute input embedding this encoding uses by default ('none', 'sinusoidal', 'learned')
    default_input_positions = "sinusoidal"
    #: whether `reset_to_identity` can make it add nothing (warm start from stock checkpoints)
    starts_as_identity = True

    def __init__(self, args: argparse.Namespace, dims: "ModelDims"):
        super().__init__()
        self.dims = dims
        # Absolute (B, T) positions of the tokens of the current call, set by the stacks:
        # 'encoder' (source tokens), 'decoder' (target tokens of this step), 'source' (keys of
        # cross-attention). 0-based, counted over non-padding tokens. `token_ranges`: the same
        # announced as `Positions` (every row alike: `shared_range`), None where they are not.
        self.token_positions: Dict[str, Tensor] = {}
        self.token_ranges: Dict[str, Optional[Positions]] = {}
        self.cache = EncodingCache()

    @staticmethod
    def add_args(parser: argparse.ArgumentParser):
        """Command-line options of this encoding (names prefixed with the encoding name)."""

    # --- called by the stacks -------------------------------------------------------------
    def begin(self, role: str, positions: Optional[AnyPositions] = None,
              source_positions: Optional[AnyPositions] = None, earlier: int = 0):
        """A stack ('encoder' or 'decoder') starts a forward pass: forget per-pass results.
        `earlier`: target tokens before this call's (incremental decoding: the cached steps)."""
        self.cache.begin(role, earlier)
        for name, given in ((role, positions), ("source", source_positions)):
            if given is not None:
                self.token_positions[name] = tensor_of(given)
                self.token_ranges[name] = given if isinstance(given, Positions) else None

    def announced_range(self, positions: Optional[Tensor]) -> Optional[Positions]:
        """The `Positions` a stack announced whose tensor `positions` is (every row alike), or None."""
        for announced in self.token_ranges.values():
            if announced is not None and announced.tensor is positions:
                return announced
        return None

    def memoize(self, key: tuple, compute: Callable[[], Tensor]) -> Tensor:
        """`EncodingCache.memoize`: a position-only term computed once per forward and shared across
        layers; `key[0]` is the role whose next `begin` drops it."""
        return self.cache.memoize(key, compute)

    def recorded(self, function: Callable) -> Callable:
        """`EncodingCache.recorded`: `function` for non-reentrant activation checkpointing."""
        return self.cache.recorded(function)

    def in_recorded_run(self) -> bool:
        return self.cache.in_recorded_run()

    def __getstate__(self):
        """Copies (fairseq's EMA deep-copies the model) start without this pass's positions (the
        cache copies itself empty)."""
        state = super().__getstate__()
        state.update(token_positions={}, token_ranges={})
        return state

    # --- the hooks, called by PositionalAttention -----------------------------------------
    def project(self, role: str, layer: int, which: str, x: Tensor, positions: Optional[Tensor]) -> Tensor:
        """Projected q/k/v (T, B, E) of tokens at absolute `positions` (B, T) -> same shape."""
        return x

    def projection_bias(self, role: str, layer: int, which: str, positions: Optional[Tensor]) -> Optional[Tensor]:
        """The bias of each token's q/k/v projection (T, B, E), (T, 1, E) shared by the batch or
        (E,) for every token alike, used in place of the projection's own bias (FLOATER: b(t_i));
        None keeps the projection as it is. Positions are (B, T)."""
        return None

    def step_terms(self, role: str, layer: int, query_positions: AnyPositions,
                   key_positions: AnyPositions) -> Optional[StepTerms]:
        """One query (a decoding step) against consecutive keys: the encoding's terms as
        `StepTerms`, used instead of `logit_bias`, `relative_logits` and `relative_values` for the
        call; None: no such form (the hooks serve the step)."""
        return None

    def logit_bias(self, role: str, layer: int, query_positions: AnyPositions,
                   key_positions: AnyPositions) -> Optional[Tensor]:
        """(H, Tq, Tk) added to the scaled logits; positions are 1-D."""
        return None

    def relative_logits(self, role, layer, query: Tensor, key: Tensor, query_positions, key_positions,
                        future_blocked: bool = False, content_folded: bool = False) -> Optional[Tensor]:
        """(B, H, Tq, Tk) added to the scaled logits; `query` (B, H, Tq, D) is already scaled by
        1/sqrt(D), `key` is (B, H, Tk, D). `future_blocked`: the attention mask blocks every key
        after its query (fairseq's future mask, checked), so those entries may hold any finite value.
        `content_folded`: the attention adds `content_query` to the queries of its product with the
        keys, so the term it stands for is left out here."""
        return None

    def content_query(self, role: str, layer: int, dtype: torch.dtype) -> Optional[Tensor]:
        """(H, 1, D) or None: a vector u per head whose logit term u.k_j (every key j; scaled as the
        queries) the attention may fold into its product with the keys, (q + u).k_j, instead of one
        more (B, H, Tq, Tk) addition (XL's content bias). Asked where every key carries the relative
        terms and no head is pruned; `relative_logits` is then called with `content_folded=True`."""
        return None

    def has_relative_values(self, role: str, layer: int) -> bool:
        return False

    def relative_values(self, role, layer, probs: Tensor, query_positions, key_positions) -> Optional[Tensor]:
        """(B, H, Tq, D) added to the attention output, from probabilities (B, H, Tq, Tk)."""
        return None

    # --- optional: the logit terms for a fused kernel (flex_attention.py) ------------------
    def distance_logits(self, role, layer, query: Tensor, key: Tensor, query_positions: AnyPositions,
                        key_positions: AnyPositions) -> Optional[DistanceLogits]:
        """The terms `logit_bias` + `relative_logits` add in this layer, as a table per distance
        (see `DistanceLogits`) instead of a (B, H, Tq, Tk) tensor; arguments as `relative_logits`,
        positions consecutive (`position_range`). An encoding that overrides it promises exactly
        those terms (the fused path calls neither of the two hooks) and returns None where the
        layer has none. Not overridden: PositionalAttention never takes the fused path."""
        return None

    # --- warm start ------------------------------------------------------------------------
    def reset_to_identity(self):
        """Initialise so that the encoding adds nothing (used when converting stock checkpoints)."""


#: the hooks through which an encoding changes the projected q, k, v
PROJECTION_HOOKS = ("projection_bias", "project")
#: the hooks through which an encoding adds relative terms to self-attention
RELATIVE_HOOKS = ("step_terms", "logit_bias", "relative_logits", "content_query", "has_relative_values",
                  "relative_values", "distance_logits")
_HOOKS = frozenset(PROJECTION_HOOKS + RELATIVE_HOOKS)
_CLASS_HOOK_USE: Dict[type, Tuple[bool, bool]] = {}


def overrides(kind: type, hooks) -> bool:
    """Whether the class `kind` has its own version of any of `hooks` (not the neutral default)."""
    return any(getattr(kind, name) is not getattr(PositionalEncoding, name) for name in hooks)


def hook_use(encoding: PositionalEncoding) -> Tuple[bool, bool]:
    """(projects, relative): whether `encoding` has its own version (its class's, or one set on the
    object) of a `PROJECTION_HOOKS` hook, and of a `RELATIVE_HOOKS` hook. The attention asks only
    an encoding that has: the neutral defaults add nothing. Decided once per class."""
    kind = type(encoding)
    use = _CLASS_HOOK_USE.get(kind)
    if use is None:
        use = _CLASS_HOOK_USE[kind] = (overrides(kind, PROJECTION_HOOKS), overrides(kind, RELATIVE_HOOKS))
    own = encoding.__dict__
    if not (use[0] and use[1]) and not _HOOKS.isdisjoint(own):
        use = (use[0] or any(name in own for name in PROJECTION_HOOKS),
               use[1] or any(name in own for name in RELATIVE_HOOKS))
    return use


def adds_logit_terms(encoding: PositionalEncoding) -> bool:
    """Whether `encoding` adds anything to the logits: its own `logit_bias` or `relative_logits`
    (its class's, or one set on the object, as `hook_use`)."""
    hooks = ("logit_bias", "relative_logits")
    return overrides(type(encoding), hooks) or any(name in encoding.__dict__ for name in hooks)


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


def build_encoding(name: str, args, dims: ModelDims) -> PositionalEncoding:
    if name not in ENCODINGS:
        raise ValueError(f"unknown positional encoding {name!r}; choose one of {sorted(ENCODINGS)}")
    return ENCODINGS[name](args, dims)


def layers_with_bias(option: str, role: str, layer: int) -> bool:
    """The `--*-layers first|all` choice shared by the scalar-bias encodings."""
    return option == "all" or layer == 0


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
