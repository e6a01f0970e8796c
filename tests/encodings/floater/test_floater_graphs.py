"""FLOATER's solve replayed from CUDA graphs (posenc_fairseq/encodings/floater/graphs.py) against the eager
solve on the same device: equal bit for bit (the same operations in the same order), across lengths that
share a graph and changes that need another, without the host waiting per solve. On the CPU the graphs'
fallback runs (the same buffers, padding and copies, the loops called instead of replayed); `pytest -m device
--device cuda` runs the tests that take the `device` fixture on the GPU (tests/devices.py)."""
import contextlib
import copy

import pytest
import torch

from posenc_fairseq.encodings.cache import EncodingCache
from posenc_fairseq.encodings.floater import graphs, solver
from posenc_fairseq.encodings.floater.solver import TABLEAUS, HiddenSpaceSolve

from floater_util import floater_model, perturb
from test_floater_solver import assert_second_derivative_refused


@pytest.fixture(autouse=True)
def python_loops(monkeypatch):
    """The eager solves run the Python loops (on the CPU the compiled loops would otherwise serve the
    eager solve: close to the loops, not equal)."""
    monkeypatch.setattr(solver, "floater_solve", None)


@pytest.fixture
def cache():
    """Where the solves keep their graphs and constants (an encoding's cache): each test starts empty."""
    return EncodingCache()


def kept_graphs(cache: EncodingCache) -> dict:
    return cache.constants.get("cuda graphs", {})


def inputs(device, dtype=torch.float32, rows=6, dim=8, hidden=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    made = [torch.randn(rows, dim, generator=generator), 0.3 * torch.randn(hidden, dim + 1, generator=generator),
            0.3 * torch.randn(hidden, generator=generator), 0.3 * torch.randn(dim, hidden + 1, generator=generator),
            0.3 * torch.randn(dim, generator=generator)]
    return [tensor.to(device=device, dtype=dtype).requires_grad_() for tensor in made]


def solved(function, settings, tensors, upstream=None):
    """The states and, given `upstream`, the gradients of every input."""
    states = function(*settings, *tensors)
    if upstream is None:
        return states, []
    return states.detach(), list(torch.autograd.grad(states, tensors, upstream))


def assert_graphed_equals_eager(settings, tensors, grad=True):
    generator = torch.Generator().manual_seed(settings[2])
    eager, eager_grads = solved(HiddenSpaceSolve.apply, settings, tensors)
    upstream = torch.randn(eager.shape, generator=generator, dtype=eager.dtype).to(eager.device) if grad else None
    eager, eager_grads = solved(HiddenSpaceSolve.apply, settings, tensors, upstream)
    graphed, graphed_grads = solved(graphs.graphed_solve, settings, tensors, upstream)
    assert torch.equal(graphed, eager) and graphed.dtype == eager.dtype and graphed.device == eager.device
    assert len(graphed_grads) == len(eager_grads)
    for name, got, expected in zip(("y0", "W1", "c1", "W2", "c2"), graphed_grads, eager_grads):
        assert torch.equal(got, expected), name


def test_the_graphed_solve_equals_the_eager_solve_exactly(device, cache):
    """Forward and every gradient, for two lengths in one bucket (one graph), a later start (an
    extended table), a solve without gradient, then another dtype and other options: each of those
    a graph of its own, captured for it."""
    tensors = inputs(device)
    rk4, memo = TABLEAUS["rk4"], cache.constant
    for first, last in [(0, 13), (0, 11), (5, 14)]:  # 13, 11 and 9 intervals: the bucket of 16
        assert_graphed_equals_eager((rk4, first, last, 0.1, 3, memo), tensors)
    assert len(kept_graphs(cache)) == 1
    with torch.no_grad():
        assert_graphed_equals_eager((rk4, 0, 13, 0.1, 3, memo), tensors, grad=False)
    assert len(kept_graphs(cache)) == 2  # without gradient: no backward graph, no relus kept
    for settings, dtype in [((rk4, 0, 13, 0.1, 3, memo), torch.float64),
                            ((TABLEAUS["midpoint"], 0, 13, 0.1, 3, memo), torch.float32),
                            ((rk4, 0, 13, 0.1, 2, memo), torch.float32), ((rk4, 0, 13, 0.05, 3, memo), torch.float32)]:
        before = len(kept_graphs(cache))
        assert_graphed_equals_eager(settings, inputs(device, dtype))
        assert len(kept_graphs(cache)) == before + 1
    assert {key.device for key in kept_graphs(cache)} == {tensors[0].device}


def test_a_training_solve_does_not_wait_on_the_host(device, cache):
    """Once a bucket's graphs are captured, a solve of another length in it and its backward never
    synchronise with the host (torch.cuda.set_sync_debug_mode("error") raises at any implicit sync).
    On the CPU the fallback runs, where there is nothing to wait for."""
    tensors = inputs(device)
    rk4, memo = TABLEAUS["rk4"], cache.constant
    solved(graphs.graphed_solve, (rk4, 0, 13, 0.1, 3, memo), tensors, torch.ones(14, 6, 8, device=device))  # captures
    assert_captured_solve_runs_without_host_waits(device, (rk4, 0, 11, 0.1, 3, memo), tensors)
    assert len(kept_graphs(cache)) == 1


def test_a_solve_whose_stages_are_not_kept_replays_chunks_equal_to_the_eager_solve(device, cache, monkeypatch):
    """A solve with gradient whose stages exceed KEEP_STAGES_BYTES (at base size already at 512
    positions) replays CHUNK intervals at a time, forward in order and backward in reverse, recomputing
    each interval as the eager solve does: states and every gradient equal the eager (unkept) solve's bit
    for bit, for lengths of whole chunks, a part-filled last chunk, one chunk, and a later start, all
    from one pair of graphs; and on CUDA without the host waiting once they are captured."""
    for module in (solver, graphs):  # every solve with gradient: stages not kept
        monkeypatch.setattr(module, "KEEP_STAGES_BYTES", 0)
    monkeypatch.setattr(graphs, "CHUNK", 8)  # (a multiple of the length buckets' BUCKET)
    tensors = inputs(device)
    rk4, memo = TABLEAUS["rk4"], cache.constant
    for first, last in [(0, 13), (0, 16), (0, 3), (5, 14)]:  # 13, 16, 3 and 9 intervals
        assert_graphed_equals_eager((rk4, first, last, 0.1, 3, memo), tensors)
    chunk_graphs = cache.constants.get("cuda chunk graphs", {})
    assert len(chunk_graphs) == 1 and next(iter(chunk_graphs)).intervals == 8
    assert kept_graphs(cache) == {}  # no graph per length bucket
    assert_captured_solve_runs_without_host_waits(device, (rk4, 0, 11, 0.1, 3, memo), tensors)


@pytest.mark.parametrize("kept", [True, False], ids=["graphed", "chunked"])
def test_a_second_derivative_of_the_graphed_solve_is_refused(cache, kept, monkeypatch):
    if not kept:
        for module in (solver, graphs):
            monkeypatch.setattr(module, "KEEP_STAGES_BYTES", 0)
    assert_second_derivative_refused(lambda *settings: graphs.graphed_solve(*settings[:5], cache.constant,
                                                                            *settings[6:]))


def assert_captured_solve_runs_without_host_waits(device, settings, tensors):
    """The graphed solve of `settings` (its graphs captured already) and its backward: on CUDA no implicit
    synchronisation (torch.cuda.set_sync_debug_mode("error") raises at one); equal to the eager solve."""
    upstream = torch.ones(settings[2] - settings[1] + 1, *tensors[0].shape, device=device)
    guard = contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.synchronize()
        guard = sync_errors()
    with guard:
        states, grads = solved(graphs.graphed_solve, settings, tensors, upstream)
    eager, eager_grads = solved(HiddenSpaceSolve.apply, settings, tensors, upstream)
    assert torch.equal(states, eager) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


@contextlib.contextmanager
def sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_model_table_and_its_gradients_equal_the_eager_ones_with_the_graphs_on(translation_data, device,
                                                                                  monkeypatch):
    """A FLOATER model's table and the gradients of h and every b(0) with POSENC_FLOATER_CUDA_GRAPHS=1
    (a CUDA model's solve then stays on the GPU) equal the eager Python loops on the same device. The
    graphs are the encoding's own (its cache): a copy of the model starts without them."""
    model, _, encoding = floater_model(translation_data)
    perturb(model)
    model.to(device)
    parameters = [*encoding.dynamics.parameters(), *encoding.initial_parameters()]
    upstream = torch.randn(21, len(encoding._slots), encoding.dims.embed_dim,
                           generator=torch.Generator().manual_seed(3)).to(device)
    monkeypatch.setattr(solver, "solve_device", lambda device, *args: device)  # the eager solve on the device
    reference = encoding.extend(encoding.solve(13), 21)  # a solve and its extension
    reference_grads = torch.autograd.grad(reference, parameters, upstream)
    monkeypatch.undo()
    monkeypatch.setattr(solver, "floater_solve", None)
    monkeypatch.setenv(graphs.ENABLE, "1")
    table = encoding.extend(encoding.solve(13), 21)  # two graphs: 12 and 8 intervals, with gradient
    grads = torch.autograd.grad(table, parameters, upstream)
    assert len(kept_graphs(encoding.cache)) == 2
    assert {key.device for key in kept_graphs(encoding.cache)} == {torch.device(device)}
    assert kept_graphs(copy.deepcopy(model).positional_encoding.cache) == {}
    assert torch.equal(table, reference)
    for got, expected in zip(grads, reference_grads):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("setting,min_work,work,expected", [
    (None, None, 10 ** 9, "cpu"),  # off (the default): the compiled CPU loops, as before
    ("1", None, 1, "cuda"),  # on, no threshold measured yet: every size on the GPU
    ("1", "1000", 999, "cpu"), ("1", "1000", 1000, "cuda")])
def test_where_a_cuda_solve_runs_with_the_graphs(setting, min_work, work, expected, monkeypatch):
    monkeypatch.setattr(solver, "floater_solve", object())  # (built)
    for name, value in ((graphs.ENABLE, setting), (graphs.MIN_WORK, min_work)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert solver.solve_device(torch.device("cuda"), "rk4", False, work) == torch.device(expected)
    assert solver.solve_device(torch.device("cuda"), "dopri5", False, work) == torch.device("cuda")


def test_a_graph_is_only_replayed_for_what_it_was_made_for(cache):
    """Each graph keeps the key it was captured for; one whose buffers do not fit a key is made anew
    (never replayed), and the least recently used graphs are dropped beyond KEPT_GRAPHS."""
    tensors = inputs("cpu")
    rk4, memo = TABLEAUS["rk4"], cache.constant
    key = graphs.key_of(rk4, 0, 13, 0.1, 3, tensors[0], tensors[1], True)
    assert key.intervals == 16 and key.rows == 6 and key.hidden == 8 and key.grad
    entry = graphs.graph_for(key, rk4, memo, tensors[0].detach(), [t.detach() for t in tensors[1:]])
    assert entry.fits(key) and graphs.graph_for(key, rk4, memo, tensors[0], tensors[1:]) is entry
    assert graphs.graph_for(key, rk4, EncodingCache().constant, tensors[0], tensors[1:]) is not entry  # another encoding's
    other = key._replace(dtype=torch.float64)
    assert not entry.fits(other)
    kept_graphs(cache)[other] = entry  # a stale entry under another key is not replayed for it
    assert graphs.graph_for(other, rk4, memo, tensors[0].double(), [t.double() for t in tensors[1:]]) is not entry
    for substeps in range(1, graphs.KEPT_GRAPHS + 2):
        graphs.graph_for(key._replace(substeps=substeps), rk4, memo, tensors[0], tensors[1:])
    assert len(kept_graphs(cache)) == graphs.KEPT_GRAPHS


@pytest.mark.parametrize("kept", [True, False], ids=["graphed", "chunked"])
def test_a_graph_replayed_with_other_weights_equals_the_eager_solve(device, cache, kept, monkeypatch):
    """The parameters are never baked into a graph: replayed for other weights and initial values (an
    optimizer step later, the same key), the states and every gradient are the eager solve's of those."""
    if not kept:
        for module in (solver, graphs):
            monkeypatch.setattr(module, "KEEP_STAGES_BYTES", 0)
        monkeypatch.setattr(graphs, "CHUNK", 8)
    rk4, memo = TABLEAUS["rk4"], cache.constant
    for seed in (0, 1, 2):
        assert_graphed_equals_eager((rk4, 0, 13, 0.1, 3, memo), inputs(device, seed=seed))
    assert len(kept_graphs(cache)) + len(cache.constants.get("cuda chunk graphs", {})) == 1  # one graph, replayed
