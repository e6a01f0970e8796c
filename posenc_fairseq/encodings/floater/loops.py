"""FLOATER's fixed-grid loops in Python (solver.py holds the solves that run them).

`_Run`: one solve's precomputed pieces and `FixedGridSolve`'s Runge-Kutta step. `_HiddenRun`: what
`HiddenSpaceSolve`'s loops read, in Python (`_hidden_forward_loops`, `_hidden_backward_loops`, which
serve where the compiled loops of csrc/floater_solve.cpp do not run) and compiled
(`_HiddenRun.pieces`); the tests hold the compiled loops to the Python ones.
"""
import functools
from collections import OrderedDict
from typing import Any, Callable, Hashable, List, NamedTuple, Optional

import torch
from torch import Tensor


#: how a solve keeps values of their key alone across solves: `memo(key, compute)` returns compute()'s
#: value for `key` (the encoding passes its cache's constants scope, `EncodingCache.constant`)
Memo = Callable[[Hashable, Callable[[], Any]], Any]


KEPT_GRIDS = 256  # grids whose constants a memo keeps (the most recently used)


def computed_now(key: Hashable, compute: Callable[[], Any]) -> Any:
    """The `Memo` that keeps nothing (a solve called without one)."""
    return compute()


def kept_recent(memo: Memo, kind: str, size: int, key: Hashable, compute: Callable[[], Any],
                fits: Callable[[Any], bool] = lambda value: True) -> Any:
    """compute() for `key`, kept among `memo`'s `size` most recently used values of `kind` (the
    least recently used dropped); a kept value that does not `fit` is computed anew."""
    kept: OrderedDict = memo(kind, OrderedDict)
    value = kept.pop(key, None)
    if value is None or not fits(value):
        value = compute()
    kept[key] = value
    while len(kept) > size:
        kept.popitem(last=False)
    return value


class _Run:
    """One solve's precomputed pieces: the time of every stage of every step, the folded biases,
    the weights split into state and time parts, the tableau as tensors (their constants kept by
    `memo`)."""

    def __init__(self, tableau, first, last, delta, substeps, memo: Memo, y0, w1, c1, w2, c2):
        dim = y0.size(-1)
        self.tableau, self.dt, self.count = tableau, delta / substeps, y0.size(0)
        self.steps = (last - first) * substeps
        grid = (tableau_key(tableau), first, last, delta, substeps, y0.dtype, y0.device)
        constants = kept_recent(memo, "grid constants", KEPT_GRIDS, grid, lambda: grid_constants(*grid))
        self.tau, self.a, self.b, self.later = constants  # tau: (steps, stages)
        # the state and time parts of the weights, contiguous (BLAS on strided slices copies them per call)
        self.w1b, self.w2h = w1[:, :dim].contiguous(), w2[:, :-1].contiguous()
        self.w1b_t, self.w2h_t = self.w1b.T.contiguous(), self.w2h.T.contiguous()
        self.bias1 = c1 + self.tau[..., None] * w1[:, dim]  # (steps, stages, hidden)
        self.bias2 = c2 + self.tau[..., None] * w2[:, -1]  # (steps, stages, dim)
        self.k = y0.new_empty(len(tableau.b), y0.numel())

    def step(self, index: int, y: Tensor, inputs: Optional[Tensor] = None, relus: Optional[Tensor] = None) -> Tensor:
        """One Runge-Kutta step from the flat state y (1, N*d); optionally records every stage's
        input (stages, N, d) and relu output (stages, N, hidden) for the backward pass."""
        k, count = self.k, self.count
        for i in range(len(self.a)):
            if i == 0:
                stage_input = y.view(count, -1)
                if inputs is not None:
                    inputs[i].copy_(stage_input)
            else:
                stage_input = torch.addmm(y, self.a[i], k[:i], alpha=self.dt,
                                          out=inputs[i].view(1, -1) if inputs is not None else None).view(count, -1)
            hidden = torch.addmm(self.bias1[index, i], stage_input, self.w1b_t,
                                 out=relus[i] if relus is not None else None).relu_()
            torch.addmm(self.bias2[index, i], hidden, self.w2h_t, out=k[i].view(count, -1))
        return torch.addmm(y, self.b, k, alpha=self.dt)


class _HiddenRun:
    """`HiddenSpaceSolve`'s precomputed pieces (see `_Run`): also M = W1_b W2_b, the stages'
    W1_b bias2, each interval's sum of dt b_i bias2, and the views the loop indexes."""

    def __init__(self, tableau, first, last, delta, substeps, memo: Memo, y0, w1, c1, w2, c2):
        base = _Run(tableau, first, last, delta, substeps, memo, y0, w1, c1, w2, c2)
        self.tableau, self.intervals = tableau, last - first
        self.dt, self.steps, self.tau, self.substeps = base.dt, base.steps, base.tau, substeps
        self.a, self.b, self.later = base.a, base.b, base.later
        self.b_repeated = self.b.repeat(1, substeps)  # b_j of every stage of an interval's steps
        self.w1b, self.w2h, self.w2h_t, self.w1b_t = base.w1b, base.w2h, base.w2h_t, base.w1b_t
        self.bias2 = base.bias2
        self.m = self.w1b @ self.w2h  # (hidden, hidden)
        self.m_t = self.m.T.contiguous()
        per_step = self.dt * torch.einsum("i,sid->sd", self.b.view(-1), self.bias2)
        self.b2_sums = per_step.view(last - first, substeps, -1).sum(1)  # (intervals, dim)
        count, hidden, stages = y0.size(0), w1.size(0), len(tableau.b)
        self.count, self.stages = count, stages
        self.bias1 = base.bias1.view(self.steps, stages, 1, hidden)
        self.cz = self.bias2 @ self.w1b.T  # W1_b bias2 per stage (steps, stages, hidden)
        self.kz = y0.new_empty(stages, count * hidden)
        self.kz_mats, self.kz_before = self.kz.view(stages, count, hidden).unbind(0), [self.kz[:i] for i in range(stages)]
        self.pre = y0.new_empty(stages, count, hidden)  # z + bias1 of each stage of a step
        self.pre_rows = self.pre.view(stages, 1, -1).unbind(0)
        self.acc = y0.new_empty(1, count * hidden)
        self.scratch = y0.new_empty(substeps, stages, count * hidden)

    @functools.cached_property
    def cz_rows(self) -> tuple:
        """`cz` as one row per stage of every step, for the Python loops (built only where they run)."""
        return self.cz.view(-1, self.cz.size(-1)).unbind(0)

    def pieces(self) -> List[Tensor]:
        """What the compiled loops read, in csrc/floater_solve.cpp's order."""
        return [self.w1b, self.w1b_t, self.w2h, self.w2h_t, self.m, self.m_t, self.bias1.squeeze(2), self.cz,
                self.b2_sums, self.b_repeated]

    def interval(self, interval: int, state: Tensor, relus: Optional[Tensor] = None) -> Tensor:
        """The `substeps` steps of one interval from b(t_i) = `state` (N, d): the sum of b_j times
        the relu outputs over its stages (1, N*hidden). Records the relu outputs
        (substeps, stages, N*hidden) in `relus` if given."""
        record = relus if relus is not None else self.scratch
        relu_rows = record.view(-1, 1, record.size(-1)).unbind(0)
        relu_mats = record.view(-1, self.count, self.m.size(0)).unbind(0)
        kz, stages, dt = self.kz, self.stages, self.dt
        z = (state @ self.w1b_t).view(1, -1)
        acc = self.acc.zero_()
        for j in range(self.substeps):
            step = interval * self.substeps + j
            torch.add(z.view(1, self.count, -1), self.bias1[step], out=self.pre)  # every stage's z + bias1
            for i in range(stages):
                at = j * stages + i
                if i == 0:
                    torch.clamp_min(self.pre_rows[0], 0, out=relu_rows[at])
                else:
                    torch.addmm(self.pre_rows[i], self.a[i], self.kz_before[i], alpha=dt, out=relu_rows[at])
                    relu_rows[at].clamp_min_(0)
                torch.addmm(self.cz_rows[step * stages + i], relu_mats[at], self.m_t, out=self.kz_mats[i])
            z = torch.addmm(z, self.b, kz, alpha=dt)
            acc.addmm_(self.b, record[j])
        return acc


def _hidden_forward_loops(run: "_HiddenRun", y0: Tensor, keep: bool):
    """`HiddenSpaceSolve`'s forward loops in Python: states (intervals + 1, N, d) and, if `keep`, the
    relu output of every stage (steps, stages, N * hidden). (`csrc/floater_solve.cpp` compiles the same.)"""
    count, hidden, stages, substeps = y0.size(0), run.m.size(0), run.stages, run.substeps
    states = y0.new_empty(run.intervals + 1, *y0.shape)
    states[0] = y0
    relus = y0.new_empty(run.steps, stages, count * hidden) if keep else None
    for interval in range(run.intervals):
        acc = run.interval(interval, states[interval], relus[interval * substeps:(interval + 1) * substeps] if keep else None)
        torch.addmm(states[interval] + run.b2_sums[interval], acc.view(count, hidden), run.w2h_t, alpha=run.dt,
                    out=states[interval + 1])
    return states, relus


def _hidden_backward_loops(run: "_HiddenRun", states: Tensor, grad_states: Tensor, kept: Optional[Tensor],
                           reduce_kept: bool = True, grad_m: Optional[Tensor] = None):
    """`HiddenSpaceSolve`'s backward loops in Python (the exact discrete adjoint), returning
    d loss / d b(t_first) (N, d), d loss / d bias1 (steps, stages, hidden), each interval's sum of b_j r_j
    (intervals, N, hidden), d loss / d b(t_i+1) (intervals, N, d), d loss / d z at each interval's start
    (intervals, N, hidden), d loss / d M (hidden, hidden) and d loss / d cz (steps, stages, hidden).
    With `kept` and not `reduce_kept`, d loss / d kz of every stage (steps, stages, N, hidden) and None
    stand for the last two (`kept_reductions` makes them): the CUDA graphs (graphs.py) run these loops
    over a padded length and reduce over the real steps only. Without `kept`, d loss / d M is added
    into `grad_m` where given (graphs.py's chunks: one sum over all of a solve's intervals, in this
    order), else into zeros."""
    count, dim, hidden = states.size(1), states.size(2), run.m.size(0)
    stages, substeps, dt, intervals = run.stages, run.substeps, run.dt, run.intervals
    # relu outputs and d loss / d kz of every stage (when the forward kept the relus; else of one
    # interval at a time), d loss / d pre of one interval's stages
    steps = run.steps if kept is not None else substeps
    R = kept if kept is not None else states.new_empty(substeps, stages, count * hidden)
    GK = states.new_empty(steps, stages, count, hidden)
    GP = states.new_empty(substeps, stages, count, hidden)
    views = _AdjointViews(R.view(-1, count, hidden).unbind(0), GK.view(-1, 1, count * hidden).unbind(0),
                          GK.view(-1, count, hidden).unbind(0), GP.view(-1, count, hidden).unbind(0),
                          GP.view(substeps, stages, -1).unbind(0), states.new_ones(1, stages),
                          [dt * b for b in run.tableau.b])
    grad_bias1 = states.new_empty(run.steps, stages, hidden)
    sums = states.new_empty(intervals, count, hidden)  # per interval: sum of b_j r_j over its stages
    after = states.new_empty(intervals, count, dim)  # d loss / d b(t_i+1)
    starts = states.new_empty(intervals, count, hidden)  # d loss / d z at each interval's start
    if grad_m is None:
        grad_m = states.new_zeros(hidden, hidden)
    grad_cz = states.new_empty(run.steps, stages, hidden)
    gy = grad_states[-1].clone()  # d loss / d b(t) of the current grid point
    a = states.new_empty(1, count * hidden)  # d loss / d z
    for interval in reversed(range(intervals)):
        interval_steps = slice(interval * substeps, (interval + 1) * substeps)
        if kept is None:
            run.interval(interval, states[interval], R)
        relus = R[interval_steps] if kept is not None else R
        torch.mm(run.b_repeated, relus.view(substeps * stages, -1), out=sums[interval].view(1, -1))
        after[interval] = gy
        # d loss / d relu through b(t_i+1): the same for every stage of the interval (times b_j)
        through_b = (dt * gy) @ run.w2h  # (count, hidden)
        _interval_adjoint(run, views, a, through_b, interval * substeps if kept is not None else 0)
        torch.sum(GP, dim=2, out=grad_bias1[interval_steps])
        starts[interval] = a.view(count, hidden)
        # b(t_i) reaches the loss directly, through b(t_i+1) and through z = W1_b b(t_i)
        gy = grad_states[interval] + gy + starts[interval] @ run.w1b
        if kept is None:
            grad_m.addmm_(GK.view(-1, hidden).T, R.view(-1, hidden))
            torch.sum(GK, dim=2, out=grad_cz[interval_steps])
    if kept is not None:  # the weight gradients of every stage in one product
        if not reduce_kept:
            return gy, grad_bias1, sums, after, starts, GK, None
        grad_m, grad_cz = kept_reductions(GK, R)
    return gy, grad_bias1, sums, after, starts, grad_m, grad_cz


class _AdjointViews(NamedTuple):
    """The per-stage views `_hidden_backward_loops` writes through (row `at` = step * stages + stage)."""
    relu_mats: tuple  # relu outputs (N, hidden)
    gk_rows: tuple  # d loss / d kz as (1, N * hidden)
    gk_mats: tuple  # d loss / d kz as (N, hidden)
    gp_mats: tuple  # d loss / d pre of one interval's stages (N, hidden)
    gp_steps: tuple  # d loss / d pre of each step of one interval (stages, N * hidden)
    ones: Tensor  # (1, stages)
    beta: list  # dt b_i per stage


def _interval_adjoint(run: "_HiddenRun", views: _AdjointViews, a: Tensor, through_b: Tensor, first_step: int):
    """One interval's stages in reverse order: d loss / d kz and d loss / d pre of each (from
    `through_b`, the gradient reaching every relu through b(t_i+1)), leaving d loss / d z at the
    interval's start in `a`. `first_step`: the interval's first step in the relu and kz rows."""
    stages, dt, later = run.stages, run.dt, run.later
    a.zero_()  # z at the interval's end is not used (the next interval starts from b)
    for j in reversed(range(run.substeps)):
        pre_grads = views.gp_steps[j]  # (stages, count * hidden)
        for i in reversed(range(stages)):
            at = (first_step + j) * stages + i  # in the relu and kz rows
            if i + 1 < stages:
                torch.addmm(a, later[i], pre_grads[i + 1:], beta=views.beta[i], alpha=dt, out=views.gk_rows[at])
            else:
                torch.mul(a, views.beta[i], out=views.gk_rows[at])
            g_relu = torch.addmm(through_b, views.gk_mats[at], run.m, beta=run.tableau.b[i])
            torch.ops.aten.threshold_backward.grad_input(g_relu, views.relu_mats[at], 0,
                                                        grad_input=views.gp_mats[j * stages + i])
        a.addmm_(views.ones, pre_grads)


def kept_reductions(stage_grads: Tensor, relus: Tensor):
    """d loss / d M and d loss / d cz from d loss / d kz (steps, stages, N, hidden) and the relu outputs
    of every stage (the same steps): each a reduction over every step at once."""
    hidden = stage_grads.size(-1)
    return stage_grads.view(-1, hidden).T @ relus.view(-1, hidden), stage_grads.sum(2)


def tableau_key(tableau) -> tuple:
    """A Runge-Kutta tableau as nested tuples (hashable: a key of the kept constants and the graphs)."""
    return tuple(tuple(map(tuple, part)) if part and isinstance(part[0], list) else tuple(part) for part in tableau)


def grid_constants(tableau: tuple, first: int, last: int, delta: float, substeps: int, dtype: torch.dtype,
                   device: torch.device):
    """A solve's constants on its device: the time of every stage of every step (steps, stages), the
    tableau's a rows and b as (1, n) rows, and per stage i the a_li of the later stages l. Only read,
    so kept across solves (`Memo`): on CUDA, made on the CPU and copied once from pinned memory without
    blocking, so a solve neither waits on the host nor copies from the host inside a graph capture."""
    a_rows, b_row, c_nodes = tableau
    dt = delta / substeps
    step = torch.arange(first * substeps, last * substeps, dtype=torch.float64)
    start = torch.div(step, substeps, rounding_mode="floor") * delta + torch.remainder(step, substeps) * dt
    tau = start[:, None] + torch.tensor(c_nodes, dtype=torch.float64)[None, :] * dt
    stages = len(b_row)
    rows = [[list(row)] for row in a_rows] + [[list(b_row)]]
    rows += [[[a_rows[l][i] for l in range(i + 1, stages)]] for i in range(stages)]
    host = [tau.to(dtype)] + [torch.tensor(row, dtype=dtype) for row in rows]
    if device.type == "cuda":
        host = [tensor.pin_memory().to(device, non_blocking=True) for tensor in host]
    else:
        host = [tensor.to(device) for tensor in host]
    return host[0], host[1:1 + stages], host[1 + stages], host[2 + stages:]
