"""Which table of FLOATER's position biases a forward pass uses, and when a kept table is still valid.

A table is b(t_i) - b(0) for positions 0..rows-1 of every slot, (rows, slots, d) in the solve dtype.
A table for more rows is the kept one integrated onward from its last row (`Floater.extend`: equal
to a fresh solve up to the rounding of its restart point, b(0) + (b(t) - b(0))). Three kinds, each
valid for one stated thing and kept where that is said:
  - this pass's (`PassTables`, an entry of the encoding cache's model-pass scope), keyed by grad
    mode (and whether it is a K-window pass): training with K = 1 and every pass with gradient
    solve from the live parameters, once per forward pass, shared by the layers;
  - the K-update window's (`Window`, training with `--floater-recompute-every K` > 1, on `Tables`):
    valid while the window index (num_updates // K) and the options stay; solved with gradient by
    every pass of the window's first update, read detached by the passes of its later updates,
    extended from the window's parameter snapshot (saved in checkpoints, so resuming inside a window
    is exact, up to an extension's rounding where the two runs extended at other lengths);
  - evaluation's (no gradient, not training): an entry of the cache's inference scope, which is
    checked once per forward pass that starts at position 0 by value against h's parameters and
    every b(0) (`Floater.kept_value_inputs`); the entry also holds the options it was solved with.
    Grown in chunks of EVAL_CHUNK positions.
Tables are never stored in checkpoints: they would be averaged by checkpoint averaging and EMA.
A table with a position the model's dtype cannot hold raises when a pass needs it: at once outside
training, from the next pass in training (`OverflowCheck`: the pass does not wait for its solve).
"""
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor


EVAL_CHUNK = 64  # evaluation extends the table in chunks of this many positions


class Solved(NamedTuple):
    """A table and the first position whose bias the model cannot take (len if none, or if the check is
    read later: `OverflowCheck`)."""
    values: Tensor
    first_overflow: int


class BiasLimit(NamedTuple):
    """The largest |b(t) - b(0)| a model takes (`bias_limit`), and its dtype (for the message)."""
    dtype: torch.dtype
    largest: float


def bias_limit(model_dtype: torch.dtype, width: int) -> BiasLimit:
    """What the model's dtype holds, and no more than keeps the attention's products of two such biases
    over `width` coordinates finite where they are computed (float32, or float64 for a float64 model):
    sqrt(max / width). In fp16 its dtype's 65504; in float32 and bf16 about 1e18 at usual widths, which
    only a runaway flow reaches (there a bias float32 holds gave inf logits, then NaN outputs)."""
    products = torch.finfo(torch.promote_types(model_dtype, torch.float32)).max
    return BiasLimit(model_dtype, min(torch.finfo(model_dtype).max, math.sqrt(products / width)))


def overflow_error(first: int, peak: float, limit: BiasLimit, rows: int, earlier_pass: bool = False) -> ValueError:
    """The error for a table whose position `first` (|b(t) - b(0)| = `peak`) is beyond `limit`."""
    where = "in an earlier training pass, " if earlier_pass else ""
    return ValueError(
        f"FLOATER position biases overflow at position {first} (|b(t) - b(0)| = {peak:.3g}, more than the "
        f"{limit.largest:.3g} a {limit.dtype} model's attention takes) {where}for an input of {rows} positions: the "
        "learned dynamics grow without bound beyond the lengths seen in training. Train on longer inputs or with a "
        "smaller --floater-delta; load a trained model with its flow stopped where its training inputs ended "
        f"(--model-overrides \"{{'floater_stop_position': N}}\", N below {first}); or shorten the input "
        "(docs/floater.md)")


def overflow_on_device(values: Tensor, limit: BiasLimit) -> Tensor:
    """(2,) float64 on `values`' device, without a host read: the first position whose bias is beyond
    `limit` (or inf/NaN; len(values) if none) and that row's peak |b(t) - b(0)| (the last row's if none)."""
    peaks = values.detach().abs().flatten(1).amax(dim=1)
    bad = ~(peaks <= limit.largest)  # also NaN
    count = peaks.size(0)
    first = torch.where(bad, torch.arange(count, device=peaks.device), count).min()
    peak = peaks.gather(0, first.clamp(max=count - 1).view(1))
    return torch.cat([first.view(1).double(), peak.double()])


def checked(values: Tensor, limit: BiasLimit) -> Solved:
    """`values` with the first position beyond `limit`, read now (one host read)."""
    if values.size(0) == 0:
        return Solved(values, 0)
    return Solved(values, int(overflow_on_device(values, limit)[0]))


class OverflowCheck:
    """A training table's overflow check, read on the host when a later pass asks for a table: the
    answer (`overflow_on_device`) is copied to host memory without blocking, so the pass that solved
    the table never waits for the solve to finish, and by the next pass the device has long computed
    it (fairseq's trainer reads the gradients' norm after each backward). An overflow makes that
    pass's loss inf/NaN, which fairseq's trainer skips (fp16) or stops on; the next pass names it."""

    def __init__(self, values: Tensor, limit: BiasLimit):
        found = overflow_on_device(values, limit)
        on_cuda = found.is_cuda
        self.answer = torch.empty(2, dtype=torch.float64, pin_memory=on_cuda)
        self.answer.copy_(found, non_blocking=on_cuda)
        self.copied = None
        if on_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(found.device))
        self.limit, self.rows = limit, values.size(0)

    def raise_if_overflowed(self):
        if self.copied is not None:
            self.copied.synchronize()
        first, peak = self.answer.numpy().tolist()  # (host memory: no device read)
        if first < self.rows:
            raise overflow_error(int(first), peak, self.limit, self.rows, earlier_pass=True)


def snapshot(tensors, dtype: torch.dtype) -> Tensor:
    """The values of `tensors` as one flat vector in `dtype` (a K-window's parameters)."""
    with torch.no_grad():
        return torch.cat([tensor.detach().reshape(-1).to(dtype) for tensor in tensors])


def from_snapshot(flat: Tensor, tensors, dim: int):
    """(h's weights, b0) from a `snapshot` of (h's 4 parameters, b(0) of every slot) = `tensors`."""
    pieces, offset = [], 0
    for tensor in tensors:
        pieces.append(flat[offset: offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    return pieces[:4], torch.stack(pieces[4:]) if len(pieces) > 4 else flat.new_zeros(0, dim)


class Window:
    """The K-update window (training with K > 1): its index, the options and the parameter snapshot
    of its first pass, the update count of that pass (None for a window loaded from a checkpoint,
    whose first update is over), and its table (None until solved)."""

    def __init__(self, index: int, options: tuple, parameters: Tensor, first_update: Optional[int] = None):
        self.index, self.options, self.parameters = index, options, parameters
        self.first_update = first_update
        self.table: Optional[Solved] = None


class PassTables:
    """The tables of one forward pass (an entry of the model-pass scope)."""
    __slots__ = ("solved", "window_pass")

    def __init__(self):
        self.solved = {}  # (grad,) or ("window", grad) -> Solved
        self.window_pass = False  # this pass reads the window's table


class Tables:
    """Which table serves a pass: the K-window (kept here, saved in checkpoints), the pass's own
    (`PassTables`) or the kept evaluation table (the cache's inference scope). The methods take the
    encoding, which solves (`solve`, `extend`), names what a table depends on (`solve_inputs`,
    `table_options`) and holds the cache."""

    def __init__(self):
        self.window: Optional[Window] = None
        self.pending = []  # (the pass, its `OverflowCheck`): training tables' checks not yet read

    def start_window_pass(self, encoding, update: int, in_pass: PassTables):
        """A training pass with K > 1 at update count `update` (window update // K): the window's table if
        the window goes on past its first update, else a new window. Every pass of a window's first update solves with
        gradient from the live parameters: with --update-freq N each of its N passes, as N processes
        would, one each (the parameters do not change within an update: the same table)."""
        options, index = encoding.table_options(), update // encoding.recompute_every
        if self.window is not None and self.window.index == index and self.window.options == options:
            in_pass.window_pass = update != self.window.first_update
        else:
            self.window = Window(index, options, snapshot(encoding.solve_inputs(), encoding.solve_dtype()), update)

    @staticmethod
    def is_evaluation(encoding, values: Tensor) -> bool:
        """Whether `values` is the kept evaluation table."""
        entry = encoding.cache.inference_values.get(encoding.evaluation_key)
        return entry is not None and values is entry[1].values

    def table(self, encoding, rows: int, in_pass: PassTables) -> Solved:
        """The table serving at least positions 0..rows-1 in this pass."""
        if self.pending:
            self._read_checks(in_pass)
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in encoding.solve_inputs())
        if encoding.training and in_pass.window_pass:
            key = ("window", grad)
            solved = in_pass.solved.get(key)
            if solved is None or solved.values.size(0) < rows:  # once per pass, shared by the layers
                solved = self._window_table(encoding, rows, in_pass)
                if grad:  # keep h in the graph (zero gradient): DDP sees no unused parameters
                    touch = torch.stack([p.sum() for p in encoding.dynamics.parameters() if p.requires_grad]).sum()
                    solved = Solved(solved.values + 0.0 * touch, solved.first_overflow)
                in_pass.solved[key] = solved
            return solved
        if not encoding.training and not grad:
            return self.evaluation_table(encoding, rows)
        key = (grad,)
        solved = in_pass.solved.get(key)
        if solved is None or solved.values.size(0) < rows:
            values = encoding.solve(rows) if solved is None else encoding.extend(solved.values, rows)
            solved = in_pass.solved[key] = self._checked(encoding, values, in_pass)
            window = self.window
            if encoding.training and window is not None and (
                    window.table is None or window.table.values.size(0) < values.size(0)):
                window.table = Solved(values.detach(), solved.first_overflow)
        return solved

    def _checked(self, encoding, values: Tensor, in_pass: PassTables) -> Solved:
        """`values` with their overflow check: in training read by a later pass (`OverflowCheck`:
        no host read while the solve runs), else now."""
        if not encoding.training:
            return checked(values, encoding.bias_limit())
        self.pending.append((in_pass, OverflowCheck(values, encoding.bias_limit())))
        return Solved(values, values.size(0))

    def _read_checks(self, in_pass: PassTables):
        """Read the checks of earlier passes' tables (not this pass's: it would wait for its solve)."""
        earlier = [check for made_in, check in self.pending if made_in is not in_pass]
        if not earlier:
            return
        self.pending = [(made_in, check) for made_in, check in self.pending if made_in is in_pass]
        for check in earlier:
            try:
                check.raise_if_overflowed()
            except ValueError:
                self.window = None  # (its table overflowed: a later pass solves and checks a new one)
                raise

    def _window_table(self, encoding, rows: int, in_pass: PassTables) -> Solved:
        window = self.window
        solved = window.table
        if solved is None or solved.values.size(0) < rows:
            with torch.no_grad():
                parameters = from_snapshot(window.parameters, encoding.solve_inputs(), encoding.dims.embed_dim)
                values = encoding.solve(rows, parameters) if solved is None else \
                    encoding.extend(solved.values, rows, parameters)
            solved = window.table = self._checked(encoding, values, in_pass)
        return solved

    @staticmethod
    def evaluation_table(encoding, rows: int) -> Solved:
        """The table of the parameters as they are, kept in the inference scope (which checks them by
        value) and extended in chunks of EVAL_CHUNK positions."""
        kept = encoding.cache.inference(encoding)  # (checked by value once per pass)
        options = encoding.table_options()
        entry = kept.get(encoding.evaluation_key)
        solved = entry[1] if entry is not None and entry[0] == options else None
        if solved is None or solved.values.size(0) < rows:
            target = EVAL_CHUNK * math.ceil(rows / EVAL_CHUNK)
            with torch.no_grad():
                values = encoding.solve(target) if solved is None else encoding.extend(solved.values, target)
            solved = checked(values, encoding.bias_limit())
            kept[encoding.evaluation_key] = (options, solved)
        return solved
