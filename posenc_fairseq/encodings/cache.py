"""The encoding's one cache (`EncodingCache`): values computed from positions and parameters,
each kept in a scope that says how long it stays valid.

- pass (`memoize`): a position term computed once per forward pass of a stack and shared by its
  layers. Its `TermKey` names the role ('encoder', 'decoder', 'cross') whose stack's `end` (or next
  `begin`) drops it, so that a (H, T, T) term lives no longer than its pass's graph, and says what
  the term is and was computed from (the positions' bounds, the layer's
  table, the dtype); terms are shared only within one grad mode. A `recorded` run (non-reentrant
  activation checkpointing) replays its forward's hits and misses in the recomputation.
- inference (`inference`, `inference_value`, `range_values`): values kept across decoding steps
  and passes while gradients are off and the encoding is in eval mode (`use_kept_values`). The
  scope is checked against the tensors the encoding's kept values are computed from
  (`kept_value_inputs`: its parameters; FLOATER's also the attention biases b(0)) by value (and dtype, device, shape) once per
  pass that starts a decode or runs whole (`begin` with no earlier step), and replaced by an empty
  one when any differs: this sees every change, fairseq's optimizers' writes through p.data included (which
  move no version counter). Emptied too when autocast is not as it was (`autocast_state`): values
  computed under it keep its rounding in float32 tensors, which a check of dtypes would not see. The
  steps of one decode use it unchecked, as fairseq's incremental state uses the keys and values it
  cached at the earlier steps (parameters changed during a decode: its later steps keep the values of
  its start until another pass of the same thread that starts a decode or runs whole checks them). Entries are named by a `TermKey` as well; each holds what else it was
  computed from (options, dtype) and is recomputed when that differs.
- model pass (`model_pass`): values of one forward pass of the model, which may span both stacks:
  it starts with the encoder's `begin`, and a decoder call continues it where it reads that
  encoder's output (its stack gave the source positions right after the encoder's `begin`);
  any other decoder call (a decoder-only model, each later decoding step) starts its own. FLOATER
  keeps its pass's tables and gathered biases there.
- decode (`decode_values`): values of one decode, from the pass that starts it (`begin` with no
  earlier step) through its later steps.
- constants (`constant`): values of their key alone (no parameter), e.g. rotary's frequencies.

Each thread has its own cache (encodings/base.py, `ThreadState`); the inference scope's values are
shared by them (`KeptValues`): a thread checks them at its passes' start as above and then reads the
values it checked, which another thread's check that finds the parameters changed replaces, not
empties. Copies (fairseq's EMA deep-copies the model) and pickles start empty: entries may hold
autograd graphs that cannot be copied.
"""
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Hashable, Iterable, List, NamedTuple, Optional, Tuple

import numpy
import torch
from torch import Tensor, nn


def stack_of(role: str) -> str:
    """The stack whose layers serve the attention role: 'encoder' or 'decoder' (self and cross)."""
    return "encoder" if role == "encoder" else "decoder"


class TermKey(NamedTuple):
    """What a cached value is: two requests share the value exactly when their keys are equal.
    Built by `PositionalEncoding.term_key(role, what, *computed_from)`."""
    role: str  # the attention role that asks for it (pass scope: its stack's `end` or next `begin` drops it)
    encoding: str  # the encoding's name
    what: str  # which term, e.g. 'prior', 'projected', 'per distance'
    computed_from: tuple  # the rest that tells values apart: table or layer, distances, dtype, ...


class KeptValues:
    """The inference scope of one encoding, shared by its threads' caches: the values, and the copies
    of the tensors and the autocast state they were computed with."""

    def __init__(self):
        self.values: Dict[TermKey, Any] = {}
        self.parameter_copies: Optional[List[Tensor]] = None
        self.autocast: Optional[tuple] = None  # `autocast_state` when `values` were computed
        self.lock = threading.Lock()  # (one thread checks and replaces at a time)

    def __reduce__(self):  # copies and pickles start empty
        return KeptValues, ()


class EncodingCache:
    """See the module docstring. Plain attributes: written once per decoding step, where
    nn.Module's __setattr__ would cost. `kept`: the inference scope shared with the encoding's other
    threads' caches."""

    def __init__(self, kept: Optional[KeptValues] = None):
        self.pass_values: Dict[str, Dict[Tuple[TermKey, bool], Any]] = {}  # stack -> (key, grad mode) -> value
        self.model_pass: Dict[TermKey, Any] = {}
        self.decode_values: Dict[TermKey, Any] = {}
        self.last_stack: Optional[str] = None  # the stack of the last `begin`
        self.kept = kept if kept is not None else KeptValues()
        self.inference_values: Dict[TermKey, Any] = self.kept.values  # those this thread checked last
        self.constants: Dict[Hashable, Any] = {}
        self.inference_checked = False  # this pass has checked `inference_values` against the parameters
        self.run: Optional[_RunRecord] = None  # the `recorded` run in progress

    def __reduce__(self):  # copies and pickles start empty
        return EncodingCache, ()

    def begin(self, stack: str, earlier: int = 0, reads_encoder: bool = False):
        """`stack` ('encoder' or 'decoder') starts a forward pass (`earlier` > 0: a later decoding step
        of it; `reads_encoder`: a decoder call that reads an encoder output, whose positions it gave)."""
        if self.pass_values:
            self.pass_values.pop(stack, None)
        if earlier == 0:
            self.inference_checked = False
            if self.decode_values:
                self.decode_values = {}
        if not (reads_encoder and self.last_stack == "encoder"):
            self.model_pass = {}
        self.last_stack = stack

    def end(self, stack: str):
        """`stack`'s forward pass is over: its pass values are dropped (a recorded run's
        recomputation in backward keeps its own copy of the scope: `recorded`)."""
        if self.pass_values:
            self.pass_values.pop(stack, None)

    def clear(self):
        """Forget every value but the constants (what they were computed from changed shape), the other
        threads' kept values too (at their next check)."""
        self.pass_values, self.model_pass, self.decode_values, self.inference_values = {}, {}, {}, {}
        self.inference_checked = False
        with self.kept.lock:
            self.kept.values, self.kept.parameter_copies, self.kept.autocast = {}, None, None

    # --- pass scope -----------------------------------------------------------------------------
    def memoize(self, key: TermKey, compute: Callable[[], Any]) -> Any:
        """compute() once per forward pass for `key`, dropped by `end` or the next `begin` of the stack
        of `key.role` (a cross-attention term: the decoder's); shared only within one grad mode (a value
        computed without gradients has no graph to differentiate)."""
        stack = stack_of(key.role)
        values = self.pass_values.get(stack)
        if values is None:
            values = self.pass_values[stack] = {}
        entry = (key, torch.is_grad_enabled())
        if self.run is not None:
            return self.run.memoize(values, entry, compute)
        if entry not in values:
            values[entry] = compute()
        return values[entry]

    @contextmanager
    def apart(self):
        """Compute outside the current pass: what is memoized inside is dropped, the pass's own
        values are kept (e.g. a prior plotted between two forwards), and the inference scope is
        checked against the parameters again (they may have changed since the last pass)."""
        saved, self.pass_values = self.pass_values, {}
        self.inference_checked = False
        try:
            yield
        finally:
            self.pass_values = saved

    def recorded(self, function: Callable) -> Callable:
        """`function` for non-reentrant activation checkpointing (a layer under fairseq's
        --checkpoint-activations, a block of queries of a long input): its recomputation during
        backward must do exactly the autograd operations of its forward, so `memoize` records in
        the first run which terms it found memoized, and the second run (the recomputation) takes
        those from the pass scope again (their values, which are all it needs: gradients flow
        through the forward's graph) and computes the others as the forward did. The recomputation
        runs in its forward's scopes (`pass_scope`), since another forward may have begun in between
        (a second forward before backward: a teacher pass, a logged sample)."""
        record, forward_scope = [], []

        def run(*args, **kwargs):
            previous, replay = self.run, bool(forward_scope)
            self.run = _RunRecord(record, replay=replay)
            current = self.pass_scope() if replay else None
            if replay:
                self.set_pass_scope(forward_scope[0])
            try:
                return function(*args, **kwargs)
            finally:
                self.run = previous
                if replay:
                    self.set_pass_scope(current)
                else:
                    forward_scope.append(self.pass_scope())
        return run

    def pass_scope(self) -> tuple:
        """The scopes of the passes in progress (pass values by role, model pass), as they are now."""
        return dict(self.pass_values), self.model_pass

    def set_pass_scope(self, scope: tuple):
        self.pass_values, self.model_pass = dict(scope[0]), scope[1]

    def in_recorded_run(self) -> bool:
        """Whether a `recorded` function is running (its checkpoint covers everything it calls)."""
        return self.run is not None

    # --- inference scope ------------------------------------------------------------------------
    def inference(self, module: nn.Module) -> Dict:
        """The inference scope (for `range_values` and `inference_value`), checked once per pass
        (not per decoding step) by value against copies of `module.kept_value_inputs()` and against
        the autocast state, and emptied when any differs."""
        if not self.inference_checked:
            self.inference_checked = True
            kept, autocast = self.kept, autocast_state()
            with kept.lock:
                if autocast != kept.autocast or not same_values(kept.parameter_copies, module.kept_value_inputs()):
                    # replaced, not emptied: another thread's decode goes on reading the values it checked
                    kept.values = {}
                    kept.parameter_copies = value_copies(module.kept_value_inputs())
                    kept.autocast = autocast
                self.inference_values = kept.values
        return self.inference_values

    def inference_value(self, module: nn.Module, key: TermKey, depends_on: tuple, compute: Callable[[], Any]) -> Any:
        """compute(), kept in the inference scope while `depends_on` (what it is computed from
        besides the parameters: options, dtype) holds."""
        kept = self.inference(module)
        entry = kept.get(key)
        if entry is None or entry[0] != depends_on:
            entry = kept[key] = (depends_on, compute())
        return entry[1]

    # --- constants ------------------------------------------------------------------------------
    def constant(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """compute(), kept for good: `key` must hold everything it is computed from."""
        if key not in self.constants:
            self.constants[key] = compute()
        return self.constants[key]


class _RunRecord:
    """Which memoized terms one run of a `recorded` function found in the pass scope (True) or computed (False)."""

    def __init__(self, record: list, replay: bool):
        self.record, self.replay, self.next = record, replay, 0

    def memoize(self, memo: dict, entry: tuple, compute: Callable[[], Any]) -> Any:
        if not self.replay:
            hit = entry in memo
            self.record.append(hit)
            if not hit:
                memo[entry] = compute()
            return memo[entry]
        hit = self.record[self.next]
        self.next += 1
        if not hit:
            return compute()
        if entry in memo:
            return memo[entry]
        with torch.no_grad():  # the pass scope was cleared meanwhile: the same value, no operation recorded
            return compute()


def autocast_state() -> tuple:
    """Whether autocast is on, and in which dtype, on the CPU and on CUDA: values computed under it
    (AT5's MLP, XL's projections of the prior) are rounded as its dtype, though kept as float32."""
    return tuple(torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) for device in ("cpu", "cuda"))


def use_kept_values(module: torch.nn.Module) -> bool:
    """Kept values only in inference: no gradient to propagate, no dropout to sample."""
    return not torch.is_grad_enabled() and not module.training


#: distances a new kept range adds on each side of the first request (a pass's first decoding
#: step): the steps after it slice instead of growing the range from one distance
KEPT_MARGIN = 32


def value_copies(tensors: Iterable[Tensor]) -> List[Tensor]:
    """Copies of `tensors` to check kept values against (`same_values`)."""
    return [tensor.detach().clone() for tensor in tensors]


def same_values(copies: Optional[List[Tensor]], tensors: Iterable[Tensor]) -> bool:
    """Whether `value_copies` still equal `tensors` exactly (count, dtype, device, shape, values): a
    check by value, which fairseq's optimizers' writes through p.data cannot escape (an in-place
    version counter would). CPU tensors one by one (`equal_values`), the others at once
    (`equal_at_once`: one host read, where torch.equal would wait for the device once per tensor)."""
    tensors = list(tensors)
    if copies is None or len(copies) != len(tensors) or any(
            (copy.dtype, copy.device, copy.shape) != (tensor.dtype, tensor.device, tensor.shape)
            for copy, tensor in zip(copies, tensors)):
        return False
    pairs = list(zip(copies, tensors))
    return all(equal_values(copy, tensor) for copy, tensor in pairs if tensor.device.type == "cpu") and \
        equal_at_once([(copy, tensor) for copy, tensor in pairs if tensor.device.type != "cpu"])


def equal_at_once(pairs: List[Tuple[Tensor, Tensor]]) -> bool:
    """Whether each (copy, tensor) pair (one dtype, device and shape per pair) is equal as torch.equal
    says (NaN unequal, -0.0 == 0.0), with one host read per device and dtype: each group's tensors
    flattened into one and compared elementwise on their device. (On the CPU the copies would cost
    more than `equal_values`: docs/benchmarks.md.)"""
    groups: Dict[Tuple[torch.device, torch.dtype], List[Tuple[Tensor, Tensor]]] = {}
    for copy, tensor in pairs:
        groups.setdefault((tensor.device, tensor.dtype), []).append((copy, tensor))
    return not any(
        bool((torch.cat([copy.reshape(-1) for copy, _ in group]) !=
              torch.cat([tensor.detach().reshape(-1) for _, tensor in group])).any())
        for group in groups.values())


#: dtypes whose CPU tensors `equal_values` compares through numpy, and from how many elements on
_NUMPY_DTYPES = frozenset((torch.float64, torch.float32, torch.float16))
_NUMPY_FROM = 16384


def equal_values(copy: Tensor, tensor: Tensor) -> bool:
    """torch.equal of two tensors of one dtype, device and shape: a large CPU tensor through numpy's
    vectorised comparison where numpy has the dtype (torch.equal's CPU kernel compares one element
    at a time; numpy's call costs more for small tensors: docs/benchmarks.md). The same answer
    (NaN unequal, -0.0 == 0.0)."""
    if (tensor.device.type == "cpu" and tensor.numel() >= _NUMPY_FROM and tensor.dtype in _NUMPY_DTYPES
            and type(tensor) in (Tensor, nn.Parameter) and type(copy) is Tensor
            and not (tensor.is_neg() or copy.is_neg())):
        return bool((copy.detach().numpy() == tensor.detach().numpy()).all())
    return torch.equal(copy, tensor)


class KeptRange(NamedTuple):
    """`range_values`' entry: the values of distances low..high, computed from `depends_on`, and
    what `derive` made of slices of them, per (low, high)."""
    depends_on: tuple
    low: int
    high: int
    values: Tensor
    derived: dict


def range_values(cache: Dict, key, depends_on: tuple, low: int, high: int,
                 compute: Callable[[int, int], Tensor], dim: int,
                 derive: Optional[Callable[[Tensor], Any]] = None) -> Any:
    """compute(low, high) (values of the distances low..high along `dim`), kept in `cache[key]`
    while `depends_on` (what the values are computed from besides the parameters) holds: a request
    inside the kept range is a slice (a view) of it. A new range starts `KEPT_MARGIN` wider on each
    side; a request outside it computes a range that also doubles the kept one on the missing side,
    so a decoding step that needs one more distance than the last recomputes only O(log n) times in
    n steps. `derive`: what is made of the slice instead, kept with the kept range per (low, high)
    (the next decode's steps find it made); one `key` takes one kind of `derive` (it is not keyed)."""
    entry: Optional[KeptRange] = cache.get(key)
    if entry is None or entry.depends_on != depends_on:
        kept_low, kept_high = low - KEPT_MARGIN, high + KEPT_MARGIN
    elif low < entry.low or high > entry.high:
        size = entry.high - entry.low + 1
        kept_low = min(low, entry.low - size) if low < entry.low else entry.low
        kept_high = max(high, entry.high + size) if high > entry.high else entry.high
    else:
        kept_low, kept_high = entry.low, entry.high
    if entry is None or (entry.depends_on, entry.low, entry.high) != (depends_on, kept_low, kept_high):
        entry = cache[key] = KeptRange(depends_on, kept_low, kept_high, compute(kept_low, kept_high), {})
    if derive is None:
        return entry.values.narrow(dim, low - entry.low, high - low + 1)
    derived = entry.derived.get((low, high))
    if derived is None:
        derived = entry.derived[low, high] = derive(entry.values.narrow(dim, low - entry.low, high - low + 1))
    return derived
