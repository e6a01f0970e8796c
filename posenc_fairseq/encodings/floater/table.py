"""Which table of FLOATER's position biases a forward pass uses, and when a kept table is still valid.

A table is b(t_i) - b(0) for positions 0..rows-1 of every slot, (rows, slots, d) in the solve dtype.
A table for more rows is the kept one integrated onward from its last row (`Floater.extend`: equal
to a fresh solve). Three kinds, each valid for one stated thing and kept where that is said:
  - this pass's (`PassTables`, an entry of the encoding cache's model-pass scope), keyed by grad
    mode (and whether it is a K-window pass): training with K = 1 and every pass with gradient
    solve from the live parameters, once per forward pass, shared by the layers;
  - the K-update window's (`Window`, training with `--floater-recompute-every K` > 1, on `Tables`):
    valid while the window index (num_updates // K) and the options stay; solved with gradient on
    the window's first pass, read detached by its other passes, extended from the window's
    parameter snapshot (saved in checkpoints, so resuming inside a window is exact);
  - evaluation's (no gradient, not training): an entry of the cache's inference scope, which is
    checked once per forward pass that starts at position 0 by value against h's parameters and
    every b(0) (`Floater.kept_value_inputs`); the entry also holds the options it was solved with.
    Grown in chunks of EVAL_CHUNK positions.
Tables are never stored in checkpoints: they would be averaged by checkpoint averaging and EMA.
"""
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor


EVAL_CHUNK = 64  # evaluation extends the table in chunks of this many positions


class Solved(NamedTuple):
    """A table and the first position whose bias the model's dtype cannot hold (len if none)."""
    values: Tensor
    first_overflow: int


def checked(values: Tensor, model_dtype: torch.dtype) -> Solved:
    """`values` with the first position `model_dtype` cannot hold (inf/NaN, or beyond fp16's range)."""
    limit = torch.finfo(model_dtype).max
    peaks = values.detach().abs().flatten(1).amax(dim=1)
    bad = ~(peaks <= limit)  # also NaN
    first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else values.size(0)
    return Solved(values, first)


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
    of its first pass, and its table (None until solved)."""

    def __init__(self, index: int, options: tuple, parameters: Tensor):
        self.index, self.options, self.parameters = index, options, parameters
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

    def start_window_pass(self, encoding, index: int, in_pass: PassTables):
        """A training pass with K > 1: the window's table if the window goes on, else a new window
        (its first pass solves with gradient from the live parameters)."""
        options = encoding.table_options()
        if self.window is not None and self.window.index == index and self.window.options == options:
            in_pass.window_pass = True
        else:
            self.window = Window(index, options, snapshot(encoding.solve_inputs(), encoding.solve_dtype()))

    @staticmethod
    def is_evaluation(encoding, values: Tensor) -> bool:
        """Whether `values` is the kept evaluation table."""
        entry = encoding.cache.inference_values.get(encoding.evaluation_key)
        return entry is not None and values is entry[1].values

    def table(self, encoding, rows: int, in_pass: PassTables) -> Solved:
        """The table serving at least positions 0..rows-1 in this pass."""
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in encoding.solve_inputs())
        if encoding.training and in_pass.window_pass:
            key = ("window", grad)
            solved = in_pass.solved.get(key)
            if solved is None or solved.values.size(0) < rows:  # once per pass, shared by the layers
                solved = self._window_table(encoding, rows)
                if grad:  # keep h in the graph (zero gradient): DDP sees no unused parameters
                    touch = torch.stack([p.sum() for p in encoding.dynamics.parameters() if p.requires_grad]).sum()
                    solved = Solved(solved.values + 0.0 * touch, solved.first_overflow)
                in_pass.solved[key] = solved
            return solved
        if not encoding.training and not grad:
            return self._evaluation_table(encoding, rows)
        key = (grad,)
        solved = in_pass.solved.get(key)
        if solved is None or solved.values.size(0) < rows:
            values = encoding.solve(rows) if solved is None else encoding.extend(solved.values, rows)
            solved = in_pass.solved[key] = checked(values, encoding.model_dtype())
            window = self.window
            if encoding.training and window is not None and (
                    window.table is None or window.table.values.size(0) < values.size(0)):
                window.table = Solved(values.detach(), solved.first_overflow)
        return solved

    def _window_table(self, encoding, rows: int) -> Solved:
        window = self.window
        solved = window.table
        if solved is None or solved.values.size(0) < rows:
            with torch.no_grad():
                parameters = from_snapshot(window.parameters, encoding.solve_inputs(), encoding.dims.embed_dim)
                values = encoding.solve(rows, parameters) if solved is None else \
                    encoding.extend(solved.values, rows, parameters)
            solved = window.table = checked(values, encoding.model_dtype())
        return solved

    @staticmethod
    def _evaluation_table(encoding, rows: int) -> Solved:
        kept = encoding.cache.inference(encoding)  # (checked by value once per pass)
        options = encoding.table_options()
        entry = kept.get(encoding.evaluation_key)
        solved = entry[1] if entry is not None and entry[0] == options else None
        if solved is None or solved.values.size(0) < rows:
            target = EVAL_CHUNK * math.ceil(rows / EVAL_CHUNK)
            with torch.no_grad():
                values = encoding.solve(target) if solved is None else encoding.extend(solved.values, target)
            solved = checked(values, encoding.model_dtype())
            kept[encoding.evaluation_key] = (options, solved)
        return solved
