"""FLOATER's hidden-space solve (`solver.HiddenSpaceSolve`) replayed from CUDA graphs: the solve off the
launch path (docs/floater.md, "CUDA graphs"); off unless
POSENC_FLOATER_CUDA_GRAPHS=1.

On CUDA the eager loops launch a few kernels per Runge-Kutta stage, about 10k tiny launches per solve
and as many again in backward, so the GPU waits on the host. A graph captures the Python loops of
loops.py (`_hidden_forward_loops`, and `_hidden_backward_loops` for a solve with gradient) once per
`GraphKey` and replays them with one launch:
  - Only the loops over the intervals are captured. The pieces a solve precomputes (`_HiddenRun`) and
    the reductions over every step (`kept_reductions`, `solver.hidden_gradients`) run eagerly with the
    solve's own shapes, so every operation is the eager solve's, in its order, with its shapes: tables and
    gradients equal the eager solve's bit for bit.
  - Lengths share a graph per bucket: the intervals rounded up to a multiple of BUCKET. An interval reads
    only its own steps' pieces and the state at its start, so the padded intervals after the real ones
    change nothing before them; in backward they receive zero gradients and pass on zeros.
  - The graph reads static buffers: the solve's inputs and pieces are copied in before each replay (the
    parameters are never baked in), and its outputs copied out (the next replay overwrites them).
  - Nothing waits on the host: the grid's constants are made once and copied without blocking
    (`loops.grid_constants`), and the solve checks nothing (the overflow check is table.py's).
  - The graphs and constants live where the solve's `memo` keeps them: the encoding's cache (its
    constants scope), so they go with the model and are never shared between models.
  - A solve with gradient whose stages the eager solve would not keep (KEEP_STAGES_BYTES: at base size
    from a few hundred positions on) replays graphs of CHUNK intervals chunk after chunk instead, each
    interval recomputed in backward as the eager solve does (`ChunkGraphs`): one pair for every length.
On the CPU (no graphs) the same buffers, padding and copies run with the loops called eagerly instead
of replayed: the fallback, which the CPU tests hold to the eager solve exactly.
"""
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ...switches import choice, count
from .loops import (Memo, _hidden_backward_loops, _hidden_forward_loops, _HiddenRun, kept_recent, kept_reductions,
                    tableau_key)
from .solver import KEEP_STAGES_BYTES, hidden_gradients, single_thread, without_autocast

ENABLE = "POSENC_FLOATER_CUDA_GRAPHS"  # "1": fixed-grid solves run through this module (CUDA models on the GPU)
MIN_WORK = "POSENC_FLOATER_CUDA_GRAPHS_MIN_WORK"  # a CUDA solve stays on the GPU from this rows x hidden x steps
# rows x hidden x steps from which a CUDA model's solve is faster in graphs on the GPU than in the compiled
# CPU loops: not measured yet (scripts/gpu_benchmark.py --floater-graphs measures the two sides). Until it
# is, turning the graphs on keeps every CUDA solve on the GPU unless MIN_WORK says otherwise.
DEFAULT_MIN_WORK = 0
BUCKET = 8  # intervals rounded up to a multiple of this: lengths that differ by less share a graph
KEPT_GRAPHS = 16  # graphs kept per encoding (least recently used dropped): each holds its buffers and memory pool


def enabled() -> bool:
    """Whether the fixed-grid hidden-space solves go through the graphs (POSENC_FLOATER_CUDA_GRAPHS=1;
    0 or empty: off; any other value is refused, as `off` would otherwise read as on)."""
    return choice(ENABLE, ("", "0", "1"), "") == "1"


def gpu_min_work() -> Optional[int]:
    """The work (rows x hidden x steps) from which a CUDA model's solve runs on the GPU in graphs; None
    (always the CPU's compiled loops, `solver.solve_device`) while the graphs are off."""
    if not enabled():
        return None
    return count(MIN_WORK, DEFAULT_MIN_WORK)


class GraphKey(NamedTuple):
    """What a graph was captured for: a different value of any field needs another graph."""
    device: torch.device
    dtype: torch.dtype
    rows: int  # the independent ODEs solved together (every slot: all layers and projections)
    dim: int
    hidden: int
    tableau: tuple  # the method's coefficients (`loops.tableau_key`)
    substeps: int
    delta: float  # with substeps, the step dt that the captured operations hold as a constant
    intervals: int  # the bucket: the number of intervals the graph runs
    grad: bool  # a backward graph too, and the forward keeps every stage's relu output for it


def key_of(tableau, first: int, last: int, delta: float, substeps: int, y0: Tensor, w1: Tensor, grad: bool) -> GraphKey:
    return GraphKey(y0.device, y0.dtype, y0.size(0), y0.size(1), w1.size(0), tableau_key(tableau), substeps,
                    float(delta), BUCKET * max(1, math.ceil((last - first) / BUCKET)), grad)


class Replay:
    """`function` of static buffers: on CUDA captured in a graph at construction (after one eager run
    outside it, which makes cuBLAS's handle and workspace) and replayed per call, its outputs the same
    tensors every time; elsewhere called per call."""

    def __init__(self, function, device: torch.device):
        self.function, self.graph, self.outputs = function, None, None
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                function()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = function()

    def __call__(self):
        if self.graph is None:
            return self.function()
        self.graph.replay()
        return self.outputs


class SolveGraph:
    """The graphs of one `GraphKey`, their static buffers (`run`: the pieces of a bucket-long solve;
    `y0`; for backward the kept relus and the states' gradients) and how a solve goes in and out."""

    def __init__(self, key: GraphKey, tableau, memo: Memo, y0: Tensor, weights):
        self.key = key
        # built from copies: no static buffer may share memory with the caller's tensors
        self.run = _HiddenRun(tableau, 0, key.intervals, key.delta, key.substeps, memo, y0.clone(),
                              *(weight.detach().clone() for weight in weights))
        self.y0 = torch.zeros_like(y0)
        self.forward = Replay(lambda: _hidden_forward_loops(self.run, self.y0, key.grad), key.device)
        if key.grad:
            stages = len(tableau.b)
            self.kept = y0.new_zeros(self.run.steps, stages, key.rows * key.hidden)
            self.grad_states = y0.new_zeros(key.intervals + 1, key.rows, key.dim)
            # with the relus kept, the backward loops take only the shape of the states
            shape_only = y0.new_zeros(key.intervals + 1, key.rows, key.dim)
            self.backward = Replay(lambda: _hidden_backward_loops(self.run, shape_only, self.grad_states, self.kept,
                                                                  reduce_kept=False), key.device)

    def fits(self, key: GraphKey) -> bool:
        """Whether the static buffers are the ones `key` needs (a graph is never replayed for another)."""
        return (self.key == key and self.y0.shape == (key.rows, key.dim) and self.y0.dtype == key.dtype
                and self.y0.device == key.device and self.run.m.shape == (key.hidden, key.hidden))

    def solve(self, run: _HiddenRun, y0: Tensor):
        """States (intervals + 1, N, d) and, for a solve with gradient, every stage's relu output."""
        load_weights(self.run, run)
        load_pieces(self.run, run, 0, run.intervals)
        self.y0.copy_(y0)
        with single_thread(y0):
            states, relus = self.forward()
        return states[:run.intervals + 1].clone(), relus[:run.steps].clone() if self.key.grad else None

    def adjoint(self, run: _HiddenRun, grad_states: Tensor, relus: Tensor) -> tuple:
        """What `_hidden_backward_loops` returns for the solve (the padded intervals left out)."""
        load_weights(self.run, run)
        load_pieces(self.run, run, 0, run.intervals)
        self.kept[:run.steps].copy_(relus)
        self.grad_states[:run.intervals + 1].copy_(grad_states)
        self.grad_states[run.intervals + 1:].zero_()  # the padded intervals pass on zeros
        with single_thread(grad_states):  # (as the eager backward: the reductions too, whose bits the threads may change)
            gy, grad_bias1, sums, after, starts, stage_grads, _ = self.backward()
            grad_m, grad_cz = kept_reductions(stage_grads[:run.steps], relus)
        intervals = slice(0, run.intervals)
        return (gy.clone(), grad_bias1[:run.steps], sums[intervals], after[intervals], starts[intervals],
                grad_m, grad_cz)


def load_weights(static: _HiddenRun, run: _HiddenRun):
    """`run`'s weights into a graph's static run (its tableau constants and dt are the key's already)."""
    for name in ("w1b", "w1b_t", "w2h", "w2h_t", "m", "m_t"):
        getattr(static, name).copy_(getattr(run, name))


def load_pieces(static: _HiddenRun, run: _HiddenRun, start: int, count: int):
    """`run`'s per-step pieces of its `count` intervals from `start` into the first `count` intervals
    of a graph's static run."""
    steps = slice(start * run.substeps, (start + count) * run.substeps)
    static.bias1[:count * run.substeps].copy_(run.bias1[steps])
    static.cz[:count * run.substeps].copy_(run.cz[steps])
    static.b2_sums[:count].copy_(run.b2_sums[start:start + count])


#: intervals per replay of a solve with gradient whose stages are not kept (`ChunkGraphs`; a multiple of BUCKET)
CHUNK = 32


class ChunkGraphs:
    """The graphs of a solve with gradient whose stages would not be kept (more than KEEP_STAGES_BYTES:
    at base size, 6+6 layers d 512, already at 512 positions), which the eager `HiddenSpaceSolve` runs
    without keeping them: forward interval after interval, backward recomputing each interval before
    its adjoint. Here the same loops over CHUNK intervals (the last chunk padded) are replayed chunk
    after chunk, forward in order and backward in reverse, with d loss / d M added up in one buffer
    across the replays in the eager order: the states and gradients are the eager ones bit for bit,
    and one pair of graphs serves every length (its key's `intervals` is CHUNK)."""

    def __init__(self, key: GraphKey, tableau, memo: Memo, y0: Tensor, weights):
        self.key = key
        self.run = _HiddenRun(tableau, 0, key.intervals, key.delta, key.substeps, memo, y0.clone(),
                              *(weight.detach().clone() for weight in weights))
        self.y0 = torch.zeros_like(y0)
        self.forward = Replay(lambda: _hidden_forward_loops(self.run, self.y0, False), key.device)
        self.states = y0.new_zeros(key.intervals + 1, key.rows, key.dim)
        self.grad_states = torch.zeros_like(self.states)
        self.grad_m = y0.new_zeros(key.hidden, key.hidden)
        self.backward = Replay(lambda: _hidden_backward_loops(self.run, self.states, self.grad_states, None,
                                                              grad_m=self.grad_m), key.device)

    fits = SolveGraph.fits

    def chunks(self, run: _HiddenRun):
        """(first interval, intervals) of each chunk of `run`, in order."""
        return [(start, min(self.key.intervals, run.intervals - start))
                for start in range(0, run.intervals, self.key.intervals)]

    def solve(self, run: _HiddenRun, y0: Tensor) -> Tensor:
        """States (intervals + 1, N, d)."""
        states = y0.new_empty(run.intervals + 1, *y0.shape)
        states[0] = y0
        load_weights(self.run, run)
        for start, count in self.chunks(run):
            load_pieces(self.run, run, start, count)
            self.y0.copy_(states[start])
            with single_thread(y0):
                chunk_states, _ = self.forward()
            states[start + 1:start + count + 1] = chunk_states[1:count + 1]
        return states

    def adjoint(self, run: _HiddenRun, states: Tensor, grad_states: Tensor) -> tuple:
        """What `_hidden_backward_loops` returns for the solve without kept stages."""
        substeps, hidden = run.substeps, run.m.size(0)
        grad_bias1 = states.new_empty(run.steps, run.stages, hidden)
        grad_cz = torch.empty_like(grad_bias1)
        sums = states.new_empty(run.intervals, states.size(1), hidden)
        starts = torch.empty_like(sums)
        after = torch.empty_like(states[1:])
        self.grad_m.zero_()
        load_weights(self.run, run)
        gy = grad_states[-1]  # d loss / d b at the end of the chunk, from the chunks after it
        for start, count in reversed(self.chunks(run)):
            load_pieces(self.run, run, start, count)
            self.states[:count + 1].copy_(states[start:start + count + 1])
            self.states[count + 1:].zero_()  # padded intervals: recomputed from zeros, passing on zeros
            self.grad_states[:count].copy_(grad_states[start:start + count])
            self.grad_states[count].copy_(gy)
            self.grad_states[count + 1:].zero_()
            with single_thread(grad_states):
                gy, chunk_bias1, chunk_sums, chunk_after, chunk_starts, _, chunk_cz = self.backward()
            steps, intervals = slice(start * substeps, (start + count) * substeps), slice(start, start + count)
            grad_bias1[steps], grad_cz[steps] = chunk_bias1[:count * substeps], chunk_cz[:count * substeps]
            sums[intervals], after[intervals], starts[intervals] = (chunk_sums[:count], chunk_after[:count],
                                                                    chunk_starts[:count])
        return gy.clone(), grad_bias1, sums, after, starts, self.grad_m.clone(), grad_cz


class ChunkedSolve(torch.autograd.Function):
    """`HiddenSpaceSolve` without kept stages, its loops replayed from `ChunkGraphs`."""

    @staticmethod
    def forward(ctx, tableau, first: int, last: int, delta: float, substeps: int, memo: Memo,
                y0: Tensor, w1: Tensor, c1: Tensor, w2: Tensor, c2: Tensor) -> Tensor:
        run = _HiddenRun(tableau, first, last, delta, substeps, memo, y0, w1, c1, w2, c2)
        key = key_of(tableau, 0, CHUNK, delta, substeps, y0, w1, True)
        entry = kept_recent(memo, "cuda chunk graphs", KEPT_GRAPHS, key,
                            lambda: ChunkGraphs(key, tableau, memo, y0, (w1, c1, w2, c2)),
                            fits=lambda kept: kept.fits(key))
        states = entry.solve(run, y0)
        ctx.save_for_backward(states, w1, c1, w2, c2)
        ctx.settings, ctx.entry = (tableau, first, last, delta, substeps, memo), entry
        return states

    @staticmethod
    @once_differentiable  # (a hand-written discrete adjoint: differentiating it again would be silently wrong)
    @without_autocast
    def backward(ctx, grad_states: Tensor):
        states, w1, c1, w2, c2 = ctx.saved_tensors
        run = _HiddenRun(*ctx.settings, states[0], w1, c1, w2, c2)
        return hidden_gradients(run, [(states, ctx.entry.adjoint(run, states, grad_states))])


def graph_for(key: GraphKey, tableau, memo: Memo, y0: Tensor, weights) -> SolveGraph:
    """The graphs of `key`: kept ones (`memo`'s, the last KEPT_GRAPHS used) if their buffers fit it,
    else captured anew."""
    return kept_recent(memo, "cuda graphs", KEPT_GRAPHS, key, lambda: SolveGraph(key, tableau, memo, y0, weights),
                       fits=lambda entry: entry.fits(key))


class GraphedSolve(torch.autograd.Function):
    """`HiddenSpaceSolve` with its loops replayed from the graphs of the solve's `GraphKey` (`grad`:
    whether the solve is differentiated, which the graph key needs: inside forward grad mode is off)."""

    @staticmethod
    def forward(ctx, grad: bool, tableau, first: int, last: int, delta: float, substeps: int, memo: Memo,
                y0: Tensor, w1: Tensor, c1: Tensor, w2: Tensor, c2: Tensor) -> Tensor:
        run = _HiddenRun(tableau, first, last, delta, substeps, memo, y0, w1, c1, w2, c2)
        key = key_of(tableau, first, last, delta, substeps, y0, w1, grad)
        entry = graph_for(key, tableau, memo, y0, (w1, c1, w2, c2))
        states, relus = entry.solve(run, y0)
        ctx.save_for_backward(states, w1, c1, w2, c2, *([relus] if grad else []))
        ctx.settings, ctx.entry = (tableau, first, last, delta, substeps, memo), entry
        return states

    @staticmethod
    @once_differentiable  # (a hand-written discrete adjoint: differentiating it again would be silently wrong)
    @without_autocast
    def backward(ctx, grad_states: Tensor):
        states, w1, c1, w2, c2, relus = ctx.saved_tensors
        run = _HiddenRun(*ctx.settings, states[0], w1, c1, w2, c2)
        return (None, *hidden_gradients(run, [(states, ctx.entry.adjoint(run, grad_states, relus))]))


def graphed_solve(tableau, first, last, delta, substeps, memo: Memo, y0: Tensor, *weights: Tensor) -> Tensor:
    """`HiddenSpaceSolve`'s states, from the graphs: a solve with gradient whose stages would not be
    kept (more than KEEP_STAGES_BYTES, where the eager backward recomputes them) in chunks (`ChunkedSolve`)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (y0, *weights))
    steps, stages = (last - first) * substeps, len(tableau.b)
    if grad and steps * stages * y0.size(0) * weights[0].size(0) * y0.element_size() > KEEP_STAGES_BYTES:
        return ChunkedSolve.apply(tableau, first, last, delta, substeps, memo, y0, *weights)
    return GraphedSolve.apply(grad, tableau, first, last, delta, substeps, memo, y0, *weights)
