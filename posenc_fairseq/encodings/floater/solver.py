"""Solving FLOATER's ODE db/dt = h(t, b) for the states b(t_i) at the grid t_i = i * delta.

`solve` is the one entry: the fixed-grid methods (rk4, midpoint, euler: torchdiffeq's coefficients,
`TABLEAUS`) with h in the paper's form run in `HiddenSpaceSolve` (or `FixedGridSolve` for a wide h):
a tight loop over the subdivided grid with h's time input folded into per-step biases, and a
discrete adjoint (backpropagation through the same steps) instead of thousands of autograd nodes.
On CPU the hidden-space loops are compiled (csrc/floater_solve.cpp, the `_floater_solve` extension
that setup.py builds) and split the rows over the threads (`compiled_parts`); without the extension
the same loops run in Python (loops.py, with each solve's precomputed pieces). A CUDA model's
fixed-grid solve runs on the CPU (`solve_device`), unless POSENC_FLOATER_CUDA_GRAPHS=1 replays the
Python loops from CUDA graphs on the GPU (graphs.py). torchdiffeq does `dopri5`, the continuous
adjoint (`--floater-adjoint`) and the bounded flows. The ODE is always solved in float32 or better
with a float64 time grid, whatever the model's dtype.
"""
import contextlib
import functools
import glob
import importlib
import logging
import os
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..option_types import OptionValueError
from .dynamics import Dynamics
from .loops import Memo, _HiddenRun, _Run, _hidden_backward_loops, _hidden_forward_loops, computed_now

logger = logging.getLogger(__name__)

FIXED_GRID = ("rk4", "midpoint", "euler")
METHODS = (*FIXED_GRID, "dopri5")
# solver steps per position above this are a typo (--floater-step-size 1e-7) or a tolerance the solve's
# dtype cannot meet (dopri5 would shrink its steps without end)
MAX_STEPS_PER_POSITION = 1000
KEEP_STAGES_BYTES = 256 * 2**20  # a solve keeps its stages for backward up to this size, else recomputes
# The compiled loops split a CPU solve's rows over the torch threads when rows * hidden * d reaches this
# (a stage's product is then long enough that running parts side by side gains more than a thread costs)
PARALLEL_MIN_WORK = 2**20
PARALLEL_MIN_ROWS = 4
PACKAGE_FOLDER = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compiled_loops(load=lambda: importlib.import_module("..._floater_solve", __package__), folder=PACKAGE_FOLDER):
    """HiddenSpaceSolve's loops compiled (csrc/floater_solve.cpp, built by setup.py into the package's
    `folder`), or None: the same loops in Python. Not built is said nowhere (an install may leave it out);
    built but unloadable (for another torch, whose symbols it lacks, or another Python) is said, with how
    to rebuild it."""
    try:
        return load()
    except ModuleNotFoundError:
        built = glob.glob(os.path.join(folder, "_floater_solve*"))
        if built:  # (built for another Python: its file name's tag does not match this interpreter's)
            logger.warning("posenc_fairseq: FLOATER's compiled solve loops were built for another Python (%s); the "
                           "same loops run in Python, slower. Rebuild them: pip install --no-build-isolation "
                           "--no-deps -e <this repository>", ", ".join(os.path.basename(path) for path in built))
        return None
    except ImportError as error:
        logger.warning("posenc_fairseq: FLOATER's compiled solve loops do not load (%s); the same loops run in "
                       "Python, slower. Rebuild them for this torch: pip install --no-build-isolation --no-deps -e "
                       "<this repository>", str(error).splitlines()[0][:300])
        return None


floater_solve = compiled_loops()


class SolverOptions(NamedTuple):
    """How the ODE is solved (the options a table depends on besides the parameters)."""
    method: str
    delta: float
    substeps: int
    tolerance: float
    adjoint: bool


def solve(dynamics: Dynamics, options: SolverOptions, y0: Tensor, first: int, last: int, weights,
          memo: Memo = computed_now) -> Tensor:
    """States b(t_i) for positions i = first..last, shape (last - first + 1, N, d), from b(t_first) = y0
    with h = `dynamics` at `weights` (W1, c1, W2, c2), on y0's device and in its dtype (autocast off:
    the solve stays in float32 under --amp). `memo` keeps what the fixed-grid solves make once and
    only read (the grid's constants, the CUDA graphs): the encoding's cache."""
    with autocast_off(y0.device):
        if options.method in FIXED_GRID and not options.adjoint and dynamics.is_paper_form:
            fixed = functools.partial(fixed_grid_solve, TABLEAUS[options.method], first, last, options.delta,
                                      options.substeps, memo)
            work = y0.size(0) * weights[0].size(0) * (last - first) * options.substeps  # rows x hidden x steps
            return solved_on(solve_device(y0.device, options.method, options.adjoint, work), fixed, y0, *weights)
        return torchdiffeq_solve(dynamics, options, y0, first, last, weights)


def torchdiffeq_solve(dynamics: Dynamics, options: SolverOptions, y0: Tensor, first: int, last: int,
                      weights) -> Tensor:
    """`solve` by torchdiffeq: dopri5, the continuous adjoint, or dynamics other than the paper's form."""
    import torchdiffeq

    times = grid_times(first, last, options.delta).to(y0.device)
    if options.method in FIXED_GRID:
        kwargs = dict(method=options.method, options=dict(grid_constructor=subdivided_grid(options.substeps)))
    else:
        resolution = torch.finfo(y0.dtype).eps
        if options.tolerance < resolution:  # its error estimate would never come below it
            raise OptionValueError(f"--floater-tolerance {options.tolerance:g}: below what the solve's {y0.dtype} "
                                   f"resolves ({resolution:.2g}); dopri5 cannot meet it: give {resolution:.2g} or more")
        kwargs = dict(method=options.method, rtol=options.tolerance, atol=options.tolerance,
                      options=dict(max_num_steps=MAX_STEPS_PER_POSITION * max(last - first, 1)))
    func = dynamics.function(weights)
    try:
        if options.adjoint:
            # gradients to b(0) flow through y0 (the adjoint returns dL/dy0); h's parameters are
            # the only ones inside the integrand
            params = tuple(p for p in dynamics.parameters() if p.requires_grad)
            return torchdiffeq.odeint_adjoint(func, y0, times, adjoint_params=params, **kwargs)
        return torchdiffeq.odeint(func, y0, times, **kwargs)
    except AssertionError as error:  # torchdiffeq's adaptive step gave up
        if not any(sign in str(error) for sign in ("max_num_steps exceeded", "underflow in dt")):
            raise
        raise OptionValueError(
            f"FLOATER's dopri5 solve cannot meet --floater-tolerance {options.tolerance:g} in {y0.dtype} over positions "
            f"{first}..{last} (torchdiffeq: {error}; at most {MAX_STEPS_PER_POSITION} steps per position are allowed); "
            "give a larger tolerance or a fixed-grid --floater-method") from None


class Tableau(NamedTuple):
    """Explicit Runge-Kutta method: stage i evaluates k_i = h(t + c_i dt, y + dt sum_j a_ij k_j);
    the step is y + dt sum_i b_i k_i."""
    a: List[List[float]]
    b: List[float]
    c: List[float]


TABLEAUS = {  # torchdiffeq's fixed-grid methods, same coefficients
    "euler": Tableau([[]], [1.0], [0.0]),
    "midpoint": Tableau([[], [0.5]], [0.0, 1.0], [0.0, 0.5]),
    # torchdiffeq's 'rk4' is Kutta's 3/8 rule (rk4_alt_step_func), not the classic tableau
    "rk4": Tableau([[], [1 / 3], [-1 / 3, 1.0], [1.0, -1.0, 1.0]], [1 / 8, 3 / 8, 3 / 8, 1 / 8], [0.0, 1 / 3, 2 / 3, 1.0]),
}


def grid_times(first: int, last: int, delta: float) -> Tensor:
    """t_i = i * delta for positions first..last, float64 (exact spacing at any model dtype)."""
    return torch.arange(first, last + 1, dtype=torch.float64) * delta


def subdivided_grid(substeps: int):
    """torchdiffeq grid constructor: every interval of the output times split into `substeps`
    equal steps, so each output time is exactly a grid point (no interpolation)."""

    def construct(func, y0, t):
        if len(t) < 2 or substeps == 1:
            return t
        fractions = torch.arange(substeps, dtype=t.dtype, device=t.device) / substeps
        inner = t[:-1, None] + (t[1:] - t[:-1])[:, None] * fractions[None, :]
        return torch.cat([inner.reshape(-1), t[-1:]])

    return construct


@contextlib.contextmanager
def single_thread(tensor: Tensor):
    """One CPU thread inside, for a solve's loops: their thousands of small sequential matrix
    products gain nothing from intra-op threads, and slow down badly when another process competes
    for the cores (each product then waits for a descheduled thread). Nothing for CUDA tensors."""
    threads = torch.get_num_threads()
    if threads == 1 or tensor.is_cuda:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def autocast_off(device: torch.device):
    """Autocast off for `device`'s type: the solve's products stay in its inputs' dtype (float32 or
    better) under --amp, where autocast would run them in half precision and mix them with the
    float32 state."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else contextlib.nullcontext()


def without_autocast(backward):
    """A solve's backward with autocast off (a backward called inside an autocast region would
    otherwise run its products in half precision)."""

    @functools.wraps(backward)
    def wrapped(ctx, grad, *grads):
        with autocast_off(grad.device):
            return backward(ctx, grad, *grads)

    return wrapped


class FixedGridSolve(torch.autograd.Function):
    """States b(t_i), i = first..last, of db/dt = h(t, b) by an explicit Runge-Kutta method with
    `substeps` equal steps per interval [t_i, t_i+1], and their exact discrete gradient.

    h's time input is folded into biases: W1 [b; tau] + c1 = W1_b b + (c1 + tau w1_tau), and the
    biases of every stage of every step are computed at once. Backward runs the chain rule through
    the Runge-Kutta stages by hand (reverse accumulation over the same steps), batching the weight
    gradients of an interval into two matrix products. The stage values it needs are kept by
    forward when they fit in KEEP_STAGES_BYTES; longer solves keep only the states at the grid
    points and recompute one interval at a time.
    """

    @staticmethod
    def forward(ctx, tableau: Tableau, first: int, last: int, delta: float, substeps: int, memo: Memo,
                y0: Tensor, w1: Tensor, c1: Tensor, w2: Tensor, c2: Tensor) -> Tensor:
        with single_thread(y0):
            run = _Run(tableau, first, last, delta, substeps, memo, y0, w1, c1, w2, c2)
            states = y0.new_empty(last - first + 1, *y0.shape)
            states[0] = y0
            # what backward needs of every stage: kept when it is small, else recomputed per interval
            stages, hidden = len(tableau.b), w1.size(0)
            keep = any(ctx.needs_input_grad) and (
                run.steps * stages * y0.size(0) * (y0.size(1) + hidden) * y0.element_size() <= KEEP_STAGES_BYTES)
            inputs = y0.new_empty(run.steps, stages, *y0.shape) if keep else None
            relus = y0.new_empty(run.steps, stages, y0.size(0), hidden) if keep else None
            y = y0.reshape(1, -1)
            for interval in range(last - first):
                for j in range(substeps):
                    step = interval * substeps + j
                    y = run.step(step, y, inputs[step] if keep else None, relus[step] if keep else None)
                states[interval + 1] = y.view_as(y0)
            ctx.save_for_backward(states, w1, c1, w2, c2, *((inputs, relus) if keep else ()))
            ctx.settings = (tableau, first, last, delta, substeps, memo)
        return states

    @staticmethod
    @once_differentiable  # (a hand-written discrete adjoint: differentiating it again would be silently wrong)
    @without_autocast
    def backward(ctx, grad_states: Tensor):
        with single_thread(grad_states):
            states, w1, c1, w2, c2, *kept = ctx.saved_tensors
            run = _Run(*ctx.settings, states[0], w1, c1, w2, c2)
            tableau, substeps = run.tableau, ctx.settings[4]
            rows, (count, dim), hidden = states.size(0), states.shape[1:], w1.size(0)
            stages, dt = len(tableau.b), run.dt
            # per interval: each stage's input (Y) and relu output (R), and their gradients (G, GP)
            if not kept:
                Y = states.new_empty(substeps, stages, count, dim)
                R = states.new_empty(substeps, stages, count, hidden)
            G = states.new_empty(substeps, stages, count, dim)
            GP = states.new_empty(substeps, stages, count, hidden)
            V = states.new_empty(stages, count * dim)  # gradient reaching each stage's input
            grad_w1b, grad_w2h = states.new_zeros(hidden, dim), states.new_zeros(dim, hidden)
            grad_bias1 = states.new_empty(run.steps, stages, hidden)
            grad_bias2 = states.new_empty(run.steps, stages, dim)
            a = grad_states[-1].reshape(1, -1).clone()  # gradient with respect to the current state
            later = [torch.tensor([[tableau.a[l][i] for l in range(i + 1, stages)]], dtype=states.dtype,
                                  device=states.device) for i in range(stages)]
            for interval in reversed(range(rows - 1)):
                steps = slice(interval * substeps, (interval + 1) * substeps)
                if kept:
                    Y, R = kept[0][steps], kept[1][steps]
                else:  # recompute the interval, keeping what the chain rule needs
                    y = states[interval].reshape(1, -1)
                    for j in range(substeps):
                        y = run.step(interval * substeps + j, y, inputs=Y[j], relus=R[j])
                for j in reversed(range(substeps)):
                    for i in reversed(range(stages)):
                        g = G[j, i].view(1, -1)  # d loss / d k_i
                        if i + 1 < stages:
                            torch.addmm(a, later[i], V[i + 1:], beta=dt * tableau.b[i], alpha=dt, out=g)
                        else:
                            torch.mul(a, dt * tableau.b[i], out=g)
                        torch.ops.aten.threshold_backward.grad_input(G[j, i] @ run.w2h, R[j, i], 0, grad_input=GP[j, i])
                        torch.mm(GP[j, i], run.w1b, out=V[i].view(count, dim))
                    a.add_(V.sum(0, keepdim=True))
                grad_w2h.addmm_(G.view(-1, dim).T, R.reshape(-1, hidden))
                grad_w1b.addmm_(GP.view(-1, hidden).T, Y.reshape(-1, dim))
                torch.sum(G, dim=2, out=grad_bias2[steps])
                torch.sum(GP, dim=2, out=grad_bias1[steps])
                a.add_(grad_states[interval].reshape(1, -1))
            tau = run.tau.reshape(-1)
            grad_w1 = torch.cat([grad_w1b, (tau @ grad_bias1.view(-1, hidden))[:, None]], dim=1)
            grad_w2 = torch.cat([grad_w2h, (tau @ grad_bias2.view(-1, dim))[:, None]], dim=1)
            return (None, None, None, None, None, None, a.view_as(states[0]),
                    grad_w1, grad_bias1.sum((0, 1)), grad_w2, grad_bias2.sum((0, 1)))


class HiddenSpaceSolve(torch.autograd.Function):
    """`FixedGridSolve`'s result with one matrix product per stage instead of two (used when h's
    hidden width is at most twice the state's, the default being equal).

    h(t, b) = W2_b relu(W1_b b + bias1(t)) + bias2(t) only enters the next stage through
    W1_b b, so within an interval [t_i, t_i+1] the solve tracks z = W1_b b (N, hidden):

        pre_j = z + bias1 + dt sum_l a_jl kz_l,   r_j = relu(pre_j),   kz_j = M r_j + W1_b bias2,
        z <- z + dt sum_j b_j kz_j                                        with M = W1_b W2_b,

    starting from z = W1_b b(t_i); b itself is linear in the relu outputs:
    b(t_i+1) = b(t_i) + dt W2_b (sum over the interval's stages of b_j r_j) + dt sum b_j bias2.
    The same Runge-Kutta steps as `FixedGridSolve` in exact arithmetic, and each interval depends
    on b(t_i) alone (as there), so a table extended from its last row equals a fresh solve (up to
    the rounding of its restart point, b(0) + (b(t) - b(0))).
    Backward is the exact discrete adjoint of these operations, also one product per stage.

    The loops run compiled on CPU (csrc/floater_solve.cpp, the same operations as loops.py's
    `_hidden_forward_loops` / `_hidden_backward_loops`, which serve installs without the extension;
    a CUDA model's solve runs here too, `solve_device`), with the rows split into parts integrated
    side by side on their own threads (`compiled_parts`): the rows are independent ODEs sharing h,
    so each part is the same solve of its own rows and the weights' gradients add up over the parts.
    """

    @staticmethod
    def forward(ctx, tableau: Tableau, first: int, last: int, delta: float, substeps: int, memo: Memo,
                y0: Tensor, w1: Tensor, c1: Tensor, w2: Tensor, c2: Tensor) -> Tensor:
        run = _HiddenRun(tableau, first, last, delta, substeps, memo, y0, w1, c1, w2, c2)
        count, hidden, stages = y0.size(0), w1.size(0), len(tableau.b)
        keep = any(ctx.needs_input_grad) and run.steps * stages * count * hidden * y0.element_size() <= KEEP_STAGES_BYTES
        parts = compiled_parts(y0, hidden)  # (read before the loops take one thread)
        with single_thread(y0):
            if parts is None:
                states, relus = _hidden_forward_loops(run, y0, keep)
                relus = [relus] if keep else []
            else:
                results = floater_solve.forward(run.pieces(), tableau.a, tableau.b, run.dt, substeps,
                                                [y0[rows] for rows in parts], keep)
                states = torch.cat([result[0] for result in results], dim=1)
                relus = [result[1] for result in results] if keep else []
        ctx.save_for_backward(states, w1, c1, w2, c2, *relus)
        ctx.settings, ctx.parts = (tableau, first, last, delta, substeps, memo), parts
        return states

    @staticmethod
    @once_differentiable  # (a hand-written discrete adjoint: differentiating it again would be silently wrong)
    @without_autocast
    def backward(ctx, grad_states: Tensor):
        states, w1, c1, w2, c2, *kept = ctx.saved_tensors
        run = _HiddenRun(*ctx.settings, states[0], w1, c1, w2, c2)
        tableau, substeps, dt = run.tableau, run.substeps, run.dt
        with single_thread(states):
            if ctx.parts is None:
                parts = [(states, _hidden_backward_loops(run, states, grad_states, kept[0] if kept else None))]
            else:  # each part's states are contiguous rows of every time slice: views, no copies
                part_states = [states[:, rows] for rows in ctx.parts]
                parts = list(zip(part_states, floater_solve.backward(
                    run.pieces(), tableau.a, tableau.b, dt, substeps, part_states,
                    [grad_states[:, rows].contiguous() for rows in ctx.parts], kept)))
        return hidden_gradients(run, parts)


def hidden_gradients(run: _HiddenRun, parts) -> tuple:
    """`HiddenSpaceSolve.backward`'s result from its loops' results, [(states of a part's rows, what
    `_hidden_backward_loops` returns for them)] (also the CUDA graphs' backward, graphs.py)."""
    dim, hidden, dt, substeps = run.w1b.size(1), run.w1b.size(0), run.dt, run.substeps
    # per part: d loss / d b(t_first), d bias1, each interval's relu sums, d b(t_i+1), d z at the
    # intervals' starts, d M, d cz; the weights' gradients add up over the parts
    gy = torch.cat([result[0] for _, result in parts]) if len(parts) > 1 else parts[0][1][0]
    grad_bias1, grad_m, grad_cz = (functools.reduce(torch.add, [result[k] for _, result in parts]) for k in (1, 5, 6))
    starts_by_states = functools.reduce(torch.add, [
        result[4].reshape(-1, hidden).T @ part[:-1].reshape(-1, dim) for part, result in parts])
    after_by_sums = functools.reduce(torch.add, [
        result[3].reshape(-1, dim).T @ result[2].reshape(-1, hidden) for _, result in parts])
    after_total = functools.reduce(torch.add, [result[3].sum(1) for _, result in parts])  # (intervals, d)
    # z = W1_b b(t_i), cz = W1_b bias2, M = W1_b W2_b, b(t_i+1) = b(t_i) + dt W2_b sums + b2 sums
    grad_w1b = starts_by_states + grad_m @ run.w2h.T + grad_cz.view(-1, hidden).T @ run.bias2.view(-1, dim)
    grad_w2h = run.w1b.T @ grad_m + dt * after_by_sums
    grad_bias2 = (grad_cz @ run.w1b  # through cz, and through the b path's bias sums:
                  # (each interval's row repeated for its steps by expand: repeat_interleave may wait on the host)
                  + dt * run.b.view(1, -1, 1) * after_total[:, None].expand(-1, substeps, -1).reshape(-1, 1, dim))
    tau = run.tau.reshape(-1)
    grad_w1 = torch.cat([grad_w1b, (tau @ grad_bias1.view(-1, hidden))[:, None]], dim=1)
    grad_w2 = torch.cat([grad_w2h, (tau @ grad_bias2.view(-1, dim))[:, None]], dim=1)
    return (None, None, None, None, None, None, gy, grad_w1, grad_bias1.sum((0, 1)), grad_w2, grad_bias2.sum((0, 1)))


def compiled_parts(y0: Tensor, hidden: int) -> Optional[List[slice]]:
    """How the compiled loops split a CPU solve's rows over threads (one part per torch thread, at
    most one per PARALLEL_MIN_ROWS rows, and only when a stage's product reaches PARALLEL_MIN_WORK
    multiply-adds, so that running parts side by side gains more than a thread costs); None: the
    Python loops (CUDA, or the extension not built)."""
    if floater_solve is None or y0.is_cuda:
        return None
    count = y0.size(0)
    parts = 1
    # under a Python dispatch mode (e.g. a memory sampler) every operation of part 0 calls into Python
    # while the other parts run: slower than one part
    if count * hidden * y0.size(-1) >= PARALLEL_MIN_WORK and torch._C._len_torch_dispatch_stack() == 0:
        parts = max(1, min(torch.get_num_threads(), count // PARALLEL_MIN_ROWS))
    bounds = [round(count * i / parts) for i in range(parts + 1)]
    return [slice(start, end) for start, end in zip(bounds[:-1], bounds[1:])]


def solve_device(device: torch.device, method: str, adjoint: bool, work: int = 0) -> torch.device:
    """Where a solve of inputs on `device` runs. A CUDA solve by a fixed-grid method without the
    adjoint runs on the CPU in the compiled loops, its table then copied to the GPU: on CUDA the
    eager loops are Python's, dozens of tiny kernel launches per position (launch-bound whatever the
    GPU); unless the CUDA graphs are on (POSENC_FLOATER_CUDA_GRAPHS, graphs.py) and the solve's
    `work` (rows x hidden x steps) reaches their threshold (`graphs.gpu_min_work`, not measured yet:
    off by default). Elsewhere (CPU, the extension not built, dopri5 or the adjoint: torchdiffeq) on
    `device`."""
    if device.type == "cuda" and method in FIXED_GRID and not adjoint:
        from .graphs import gpu_min_work  # (graphs.py builds on this module)
        threshold = gpu_min_work()
        if threshold is not None and work >= threshold:
            return device
        if floater_solve is not None:
            return torch.device("cpu")
    return device


def solved_on(device: torch.device, function, y0: Tensor, *weights: Tensor) -> Tensor:
    """function(y0, *weights) computed on `device`, returned on y0's device (autograd's copies carry
    the gradients back to the inputs' device)."""
    if device == y0.device:
        return function(y0, *weights)
    return function(y0.to(device), *(weight.to(device) for weight in weights)).to(y0.device)


def fixed_grid_solve(tableau, first, last, delta, substeps, memo: Memo, y0, *weights) -> Tensor:
    """States b(t_i), i = first..last (see `FixedGridSolve`): in h's hidden space when that is
    cheaper (one (N, hidden) x (hidden, hidden) product per stage instead of two with (hidden, d))."""
    if weights[0].size(0) > 2 * y0.size(-1):
        return FixedGridSolve.apply(tableau, first, last, delta, substeps, memo, y0, *weights)
    from . import graphs  # (graphs.py builds on this module)
    if graphs.enabled():  # the CUDA graphs, or on the CPU their fallback: the same loops
        return graphs.graphed_solve(tableau, first, last, delta, substeps, memo, y0, *weights)
    return HiddenSpaceSolve.apply(tableau, first, last, delta, substeps, memo, y0, *weights)
