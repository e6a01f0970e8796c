"""FLOATER's fast fixed-grid integrator (solver.py) against torchdiffeq's own solve of the same grid
(values and gradients), the compiled loops against the Python loops, where a CUDA model's solve runs,
and the solve's precision at every model dtype and under autocast."""
import pytest
import torch
import torchdiffeq

from devices import bound
from floater_util import floater_model, perturb
from posenc_fairseq.encodings.floater import (TABLEAUS, Dynamics, FixedGridSolve, HiddenSpaceSolve, dynamics_function,
                                              grid_times, solver, subdivided_grid)
from posenc_fairseq.encodings.floater import graphs
from posenc_fairseq.encodings.floater.loops import computed_now
from util import random_batch


def random_dynamics(dim, hidden, dtype, seed=0):
    torch.manual_seed(seed)
    dynamics = Dynamics(dim, hidden).to(dtype)
    with torch.no_grad():
        dynamics.fc2.weight.normal_(0.0, 0.3)
        dynamics.fc2.bias.normal_(0.0, 0.1)
    return dynamics.weights(dtype)


@pytest.mark.parametrize("solve", [FixedGridSolve, HiddenSpaceSolve])
@pytest.mark.parametrize("keep_stages", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("method", sorted(TABLEAUS))
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_fast_solve_equals_torchdiffeq_on_the_same_grid(method, dtype, tolerance, keep_stages, solve, monkeypatch):
    if not keep_stages:  # backward recomputes each interval instead of reading kept stages
        monkeypatch.setattr(solver, "KEEP_STAGES_BYTES", 0)
    weights = [w.detach().requires_grad_() for w in random_dynamics(8, 6, dtype)]
    y0 = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    first, last, delta, substeps = 3, 11, 0.1, 4  # starting beyond 0: how tables are extended
    ours = solve.apply(TABLEAUS[method], first, last, delta, substeps, computed_now, y0, *weights)
    reference = torchdiffeq.odeint(dynamics_function(*weights), y0, grid_times(first, last, delta), method=method,
                                   options=dict(grid_constructor=subdivided_grid(substeps)))
    scale = reference.abs().max()
    assert ours.dtype == dtype and (ours - reference).abs().max() <= tolerance * scale
    assert (reference[-1] - reference[0]).abs().max() > 0.1  # the states really move
    upstream = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, [y0, *weights], upstream)
    reference_grads = torch.autograd.grad(reference, [y0, *weights], upstream)
    for name, got, expected in zip(("y0", "W1", "c1", "W2", "c2"), ours_grads, reference_grads):
        assert (got - expected).abs().max() <= tolerance * expected.abs().max(), name


@pytest.mark.parametrize("solve", [FixedGridSolve, HiddenSpaceSolve])
def test_fast_solve_gradients_match_finite_differences(solve):
    weights = [w.detach().requires_grad_() for w in random_dynamics(4, 3, torch.float64, seed=2)]
    y0 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda y, *w: solve.apply(TABLEAUS["rk4"], 0, 4, 0.3, 2, computed_now, y, *w), (y0, *weights))


def assert_second_derivative_refused(solve):
    """A gradient of the solve's gradient (create_graph=True) is refused: its backward is a hand-written
    discrete adjoint, whose own graph (where recorded at all) would give a wrong second derivative."""
    weights = [w.detach().requires_grad_() for w in random_dynamics(3, 3, torch.float64, seed=2)]
    y0 = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    states = solve(TABLEAUS["rk4"], 0, 2, 0.3, 1, computed_now, y0, *weights)
    gradient, = torch.autograd.grad((states ** 2).sum(), weights[0], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (gradient ** 2).sum().backward()


@pytest.mark.parametrize("solve,loops", [(FixedGridSolve, "python"), (HiddenSpaceSolve, "compiled"),
                                         (HiddenSpaceSolve, "python")])
def test_a_second_derivative_of_the_solve_is_refused(solve, loops, monkeypatch):
    """(The compiled loops ran their backward without a graph, so a second derivative came out wrong,
    silently: 0.22 where finite differences give 5.65.)"""
    if loops == "python":
        monkeypatch.setattr(solver, "floater_solve", None)
    assert_second_derivative_refused(solve.apply)


@pytest.mark.parametrize("hidden,expected", [(6, HiddenSpaceSolve), (16, HiddenSpaceSolve), (17, FixedGridSolve)])
def test_the_solve_in_hidden_space_where_it_is_cheaper(hidden, expected, monkeypatch):
    """fixed_grid_solve takes the hidden-space form up to twice the state's width (one hidden x
    hidden product per stage instead of two hidden x state ones)."""
    monkeypatch.delenv(graphs.ENABLE, raising=False)  # the default path (test_floater_graphs.py: the graphs)
    used = []
    for solve in (FixedGridSolve, HiddenSpaceSolve):
        monkeypatch.setattr(solve, "apply", lambda *args, solve=solve: used.append(solve))
    solver.fixed_grid_solve(TABLEAUS["rk4"], 0, 3, 0.1, 2, computed_now, torch.zeros(2, 8), *random_dynamics(8, hidden, torch.float32))
    assert used == [expected]


def test_the_compiled_loops_are_built():
    """setup.py builds csrc/floater_solve.cpp (the Makefile's install); without it every solve would
    silently take the slower Python loops."""
    assert solver.floater_solve is not None


def test_compiled_loops_that_do_not_load_are_said_not_built_ones_never(caplog, tmp_path):
    """Built for another torch (its symbols missing) or another Python (its file not found by import), the
    extension fell back to the Python loops without a word; not built at all (an install may leave it
    out), it still does."""
    def built_for_another_torch():
        raise ImportError("_floater_solve.so: undefined symbol: _ZN3c1017RegisterOperators")

    def not_found():
        raise ModuleNotFoundError("No module named 'posenc_fairseq._floater_solve'")

    other_python = tmp_path / "other"
    other_python.mkdir()
    (other_python / "_floater_solve.cpython-310-x86_64-linux-gnu.so").write_bytes(b"")
    with caplog.at_level("WARNING", logger=solver.__name__):
        assert solver.compiled_loops(not_found, folder=tmp_path) is None and not caplog.records
        assert solver.compiled_loops(built_for_another_torch) is None
        assert solver.compiled_loops(not_found, folder=other_python) is None
    torch_record, python_record = caplog.records
    assert "undefined symbol" in torch_record.getMessage()
    assert "another Python (_floater_solve.cpython-310-x86_64-linux-gnu.so)" in python_record.getMessage()
    assert all("pip install --no-build-isolation" in record.getMessage() for record in caplog.records)
    assert solver.compiled_loops() is solver.floater_solve is not None  # (this install's: built, loads)


@pytest.mark.parametrize("keep_stages", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_compiled_loops_in_parts_equal_the_python_loops(parts, keep_stages, dtype, tolerance, monkeypatch):
    """The compiled loops (rows split into parts, one thread each: the rows are independent ODEs
    sharing h) give the Python loops' states and every gradient; the thread count is restored."""
    if not keep_stages:
        monkeypatch.setattr(solver, "KEEP_STAGES_BYTES", 0)
    weights = [w.detach().requires_grad_() for w in random_dynamics(8, 6, dtype)]
    y0 = torch.randn(9, 8, dtype=dtype, requires_grad=True)
    settings = (TABLEAUS["rk4"], 2, 9, 0.1, 3, computed_now)
    upstream = torch.randn(8, 9, 8, dtype=dtype)
    monkeypatch.setattr(solver, "floater_solve", None)
    python = HiddenSpaceSolve.apply(*settings, y0, *weights)
    python_grads = torch.autograd.grad(python, [y0, *weights], upstream)
    monkeypatch.undo()
    if not keep_stages:
        monkeypatch.setattr(solver, "KEEP_STAGES_BYTES", 0)
    bounds = [round(9 * i / parts) for i in range(parts + 1)]
    monkeypatch.setattr(solver, "compiled_parts", lambda y, hidden: [slice(a, b) for a, b in zip(bounds, bounds[1:])])
    threads = torch.get_num_threads()
    compiled = HiddenSpaceSolve.apply(*settings, y0, *weights)
    compiled_grads = torch.autograd.grad(compiled, [y0, *weights], upstream)
    assert torch.get_num_threads() == threads
    assert (compiled - python).abs().max() <= tolerance * python.abs().max()
    for name, got, expected in zip(("y0", "W1", "c1", "W2", "c2"), compiled_grads, python_grads):
        assert (got - expected).abs().max() <= tolerance * expected.abs().max(), name
    if dtype == torch.float64:
        small = [w.detach().requires_grad_() for w in random_dynamics(4, 3, torch.float64, seed=3)]
        torch.autograd.gradcheck(lambda y, *w: HiddenSpaceSolve.apply(TABLEAUS["rk4"], 0, 4, 0.3, 2, computed_now, y, *w),
                                 (torch.randn(9, 4, dtype=torch.float64, requires_grad=True), *small))


@pytest.mark.parametrize("threads,work,expected", [(2, 1, 2), (4, 1, 3), (1, 1, 1), (2, 10 ** 9, 1)])
def test_rows_are_split_over_the_threads_when_the_products_are_large(threads, work, expected, monkeypatch):
    """One part per torch thread (at most one per PARALLEL_MIN_ROWS rows), only when a stage's
    product reaches PARALLEL_MIN_WORK; the parts cover the rows in order."""
    monkeypatch.setattr(solver, "PARALLEL_MIN_WORK", work)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = solver.compiled_parts(torch.zeros(13, 8), 8)
    finally:
        torch.set_num_threads(previous)
    assert len(parts) == expected and parts[0].start == 0 and parts[-1].stop == 13
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))


def test_one_part_under_a_python_dispatch_mode(monkeypatch):
    """Under a Python dispatch mode (a memory sampler, a tracer) part 0's operations call into Python
    while other parts run: the solve then keeps to one part."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(solver, "PARALLEL_MIN_WORK", 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert len(solver.compiled_parts(torch.zeros(13, 8), 8)) == 2
        with Passthrough():
            assert len(solver.compiled_parts(torch.zeros(13, 8), 8)) == 1
    finally:
        torch.set_num_threads(previous)


# (table, logits) differences from fp32 relative to their largest fp32 value: 2-4x those measured;
# without FLOATER's biases the logits differ by more than their largest value
@pytest.mark.parametrize("dtype,table_tolerance,tolerance", [(torch.float16, 1e-3, 0.015), (torch.bfloat16, 0.01, 0.08)])
def test_half_precision_model_at_2048_tokens_is_close_to_fp32(translation_data, dtype, table_tolerance, tolerance):
    model, task, encoding = floater_model(translation_data, ["--max-source-positions", "4096",
                                                             "--max-target-positions", "4096"])
    model.eval()
    perturb(model)
    with torch.no_grad():  # a trained-looking h: biases that move but stay bounded over 2048 positions
        encoding.dynamics.fc2.weight.mul_(0.003)
        encoding.dynamics.fc2.bias.mul_(0.003)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=1, src_len=2048, tgt_len=2048)
    with torch.no_grad():
        table = encoding.table(2048)
        assert table.dtype == torch.float32
        assert table[100].abs().max() > 0.1 and table[2047].abs().max() < 1e3
        reference, _ = model(src, src_lengths, prev)
        model.to(dtype)
        half_table = encoding.table(2048)
        assert half_table.dtype == torch.float32  # solved in fp32 whatever the model's dtype
        # the same table up to the rounding of the parameters to the model's dtype
        assert (half_table - table).abs().max() <= table_tolerance * table.abs().max()
        got, _ = model(src, src_lengths, prev)
    assert torch.isfinite(got).all()
    assert (got.float() - reference).abs().max() <= tolerance * reference.abs().max()


@pytest.mark.parametrize("model_device,method,adjoint,built,expected", [
    ("cuda", "rk4", False, True, "cpu"), ("cuda", "midpoint", False, True, "cpu"), ("cuda", "euler", False, True, "cpu"),
    ("cuda", "rk4", True, True, "cuda"),  # the continuous adjoint: torchdiffeq, on the GPU
    ("cuda", "dopri5", False, True, "cuda"),  # adaptive steps: torchdiffeq, on the GPU
    ("cuda", "rk4", False, False, "cuda"),  # the extension not built: the Python loops, on the GPU
    ("cpu", "rk4", False, True, "cpu"), ("cpu", "dopri5", False, True, "cpu")])
def test_a_cuda_fixed_grid_solve_runs_on_the_cpu_in_the_compiled_loops(model_device, method, adjoint, built,
                                                                       expected, monkeypatch):
    """On CUDA the Python loops launch dozens of tiny kernels per position: a fixed-grid solve
    without the adjoint runs in the compiled CPU loops instead, when they are built."""
    monkeypatch.delenv(graphs.ENABLE, raising=False)  # the default path (test_floater_graphs.py: the graphs)
    if not built:
        monkeypatch.setattr(solver, "floater_solve", None)
    assert solver.solve_device(torch.device(model_device), method, adjoint) == torch.device(expected)


def floater_solve_inputs(data, device):
    model, _, encoding = floater_model(data)
    perturb(model)
    model.to(device)
    return model, encoding, [*encoding.dynamics.parameters(), *encoding.initial_parameters()]


def test_the_solve_cuda_takes_equals_the_python_loops(translation_data, device, monkeypatch):
    """The table and every gradient of a solve as CUDA runs it (inputs copied to the CPU, the
    compiled loops, the table copied back) equal the Python loops on the inputs' own device (what
    CUDA ran before). On CPU the same function runs with CPU inputs (the copies are no-ops there)."""
    monkeypatch.delenv(graphs.ENABLE, raising=False)  # the default path (test_floater_graphs.py: the graphs)
    model, encoding, inputs = floater_solve_inputs(translation_data, device)
    upstream = torch.randn(21, len(encoding._slots), encoding.dims.embed_dim, generator=torch.Generator().manual_seed(3))
    with monkeypatch.context() as python_loops:
        python_loops.setattr(solver, "floater_solve", None)
        reference = encoding.solve(21)
        reference_grads = torch.autograd.grad(reference, inputs, upstream.to(device))
    consulted, compiled = [], []
    choose = solver.solve_device
    monkeypatch.setattr(solver, "solve_device", lambda *args: consulted.append(args) or choose(*args))
    loops = solver.floater_solve
    monkeypatch.setattr(solver, "floater_solve", type("Spy", (), {
        "forward": staticmethod(lambda *args: compiled.append(args[-2][0].device) or loops.forward(*args)),
        "backward": staticmethod(loops.backward)}))
    table = encoding.solve(21)
    grads = torch.autograd.grad(table, inputs, upstream.to(device))
    assert [args[:3] for args in consulted] == [(device, "rk4", False)] and compiled == [torch.device("cpu")]
    assert table.device == reference.device and table.dtype == torch.float32
    limit = bound(device, "floater solve")
    assert (table - reference).abs().max() <= limit * reference.abs().max() and reference.abs().max() > 0.1
    for grad, expected in zip(grads, reference_grads):
        assert grad.device == expected.device and (grad - expected).abs().max() <= limit * expected.abs().max()


@pytest.mark.parametrize("variant", [[], ["--floater-method", "dopri5"], ["--floater-adjoint"], "python loops"])
def test_the_solve_stays_float32_under_autocast(translation_data, variant, monkeypatch):
    """--amp: the solve's products stay in float32 inside an autocast region: its table and
    gradients are exactly those without autocast (backward outside the region, as fairseq calls it;
    the fixed-grid solves also inside it, where torch's own backward formulas would autocast)."""
    if variant == "python loops":
        monkeypatch.setattr(solver, "floater_solve", None)
    model, _, encoding = floater_model(translation_data, variant if isinstance(variant, list) else [])
    perturb(model)
    inputs = [*encoding.dynamics.parameters(), *encoding.initial_parameters()]
    reference = encoding.solve(9)
    reference_grads = torch.autograd.grad(reference.pow(2).sum(), inputs)
    fixed_grid = encoding.method in solver.FIXED_GRID and not encoding.adjoint
    for backward_inside in (False, True) if fixed_grid else (False,):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            table = encoding.solve(9)
            loss = table.pow(2).sum()
            grads = torch.autograd.grad(loss, inputs) if backward_inside else None
        grads = grads or torch.autograd.grad(loss, inputs)
        assert table.dtype == torch.float32 and torch.equal(table, reference)
        assert all(torch.equal(grad, expected) for grad, expected in zip(grads, reference_grads))


def test_a_dopri5_tolerance_the_solve_cannot_meet_is_refused_with_the_option(translation_data, monkeypatch):
    """dopri5's error estimate is rounded in the solve's dtype: a tolerance below its resolution is
    refused at the first solve (before, 1e-17 ran validation for minutes, 1e-30 ended in torchdiffeq's
    "underflow in dt"); one the dtype resolves but the steps cannot meet within MAX_STEPS_PER_POSITION
    per position names the option too, instead of solving on without end."""
    from posenc_fairseq.encodings.floater import solver
    from posenc_fairseq.encodings.option_types import OptionValueError

    model, _, encoding = floater_model(translation_data, ["--floater-method", "dopri5", "--floater-tolerance", "1e-07"])
    perturb(model)
    with torch.no_grad(), pytest.raises(OptionValueError, match=r"^--floater-tolerance 1e-07: below what the "
                                                                 r"solve's torch.float32 resolves \(1.2e-07\)"):
        encoding.solve(8)
    model.double()  # float64 resolves it
    with torch.no_grad():
        assert torch.isfinite(encoding.solve(8)).all()
    encoding.tolerance = 1e-6
    model.float()
    monkeypatch.setattr(solver, "MAX_STEPS_PER_POSITION", 0)  # (no step allowed)
    with torch.no_grad(), pytest.raises(OptionValueError, match=r"^FLOATER's dopri5 solve cannot meet "
                                                                 r"--floater-tolerance 1e-06 .*max_num_steps exceeded"):
        encoding.solve(8)


def test_solves_that_share_a_memo_each_equal_the_same_solve_without_one():
    """A grid's constants (the stage times, the tableau) are kept in the solve's memo (the encoding's cache,
    which an option change does not clear) under every field they depend on: solves that differ from the
    first in one of them (the step, the start, the end, the substeps, the method, the dtype), each made
    after the others with one memo, equal the same solve made without a memo, bit for bit."""
    kept = {}

    def memo(key, compute):
        if key not in kept:
            kept[key] = compute()
        return kept[key]

    base = dict(method="rk4", first=3, last=11, delta=0.1, substeps=4, dtype=torch.float64)
    variants = [base, {**base, "delta": 0.2}, {**base, "first": 2}, {**base, "last": 12}, {**base, "substeps": 3},
                {**base, "method": "midpoint"}, {**base, "method": "euler"}, {**base, "dtype": torch.float32}, base]
    for solve in (FixedGridSolve, HiddenSpaceSolve):
        kept.clear()
        for variant in variants:
            weights = random_dynamics(8, 6, variant["dtype"])
            y0 = torch.randn(5, 8, dtype=variant["dtype"], generator=torch.Generator().manual_seed(1))
            settings = (TABLEAUS[variant["method"]], variant["first"], variant["last"], variant["delta"], variant["substeps"])
            with torch.no_grad():
                expected = solve.apply(*settings, computed_now, y0, *weights)
                got = solve.apply(*settings, memo, y0, *weights)
            assert torch.equal(got, expected), (solve.__name__, variant)
        assert len(kept["grid constants"]) == len(variants) - 1  # (base solved twice: its constants found again)


def test_the_kept_grid_constants_drop_the_least_recently_used():
    """`kept_recent` keeps the `size` most recently used values: a value used again is kept over an older
    one, and the least recently used is dropped (computed anew when asked again)."""
    from posenc_fairseq.encodings.floater.loops import kept_recent

    store, computed = {}, []

    def memo(key, compute):
        if key not in store:
            store[key] = compute()
        return store[key]

    def get(key):
        return kept_recent(memo, "values", 2, key, lambda: computed.append(key) or [key])

    a, b = get("a"), get("b")
    assert get("a") is a and computed == ["a", "b"]  # used again: now "b" is the least recently used
    get("c")  # over the size: "b" dropped
    assert get("a") is a and get("c") == ["c"] and computed == ["a", "b", "c"]
    assert get("b") is not b and computed == ["a", "b", "c", "b"]


def test_a_solve_tells_where_it_runs_its_work_in_rows_hidden_and_steps(monkeypatch):
    """`solve_device` weighs a solve by its work, rows x hidden width x steps (positions - 1 intervals of
    `substeps` steps each): the CUDA graphs' threshold (graphs.gpu_min_work) is in these units."""
    seen = []
    monkeypatch.setattr(solver, "solve_device", lambda device, method, adjoint, work=0: seen.append(work) or device)
    weights = random_dynamics(8, 6, torch.float32)
    options = solver.SolverOptions("rk4", 0.1, 4, 1e-6, False)
    with torch.no_grad():
        states = solver.solve(Dynamics(8, 6), options, torch.zeros(5, 8), 3, 11, weights)
    assert states.shape == (9, 5, 8) and seen == [5 * 6 * (11 - 3) * 4]
