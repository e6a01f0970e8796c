"""kernels/triton_attention.py and its Triton kernels (triton_kernels.py): the output and every gradient,
the term's tables included, against the formula written out in float64 (a naive softmax over the
(Tq, Tk) logits). On CPU the kernels run in Triton's interpreter (tests/devices.py sets it); with
--device cuda, compiled (the `kernel_device` fixture). Whole models: tests/models/test_triton_training.py."""
import os

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.kernels import triton_attention as fused
from posenc_fairseq.kernels.masks import blocked_fill_value
from devices import bound

#: the kinds of term: a bias per distance (T5, AT5, ALiBi), vectors shared by the heads with a value
#: term (Shaw, LFHC), per-head vectors (XL, GCDF) with everything else at once
TERMS = ("bias", "shared vectors and values", "bias and vectors and values")


def formula(q, qr, k, v, bias, vectors, values, padding, causal, keep=None, dropout_p=0.0, first_column=0):
    """softmax_j(q k^T + bias[h, r] + qr . vectors[h, r], blocked logits at the dtype's finite minimum)
    (v_j + values[h, r]), r = c - first_column clamped to the tables' rows, c = j - i + Tq - 1; with
    dropout the probabilities where `keep` (B, H, Tq, Tk) is False are zero, the others scaled by
    1 / (1 - dropout_p), as torch's dropout does."""
    queries, keys = q.size(2), k.size(2)
    i, j = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
    rows = next(x.size(-1 if x is bias else -2) for x in (bias, vectors, values) if x is not None)
    column = (j - i + queries - 1 - first_column).clamp(0, rows - 1)  # (the table's row)
    logits = q @ k.transpose(-1, -2)
    if bias is not None:
        logits = logits + bias[:, column]
    if vectors is not None:
        per_column = qr @ vectors.transpose(-1, -2)  # (B, H, Tq, N)
        logits = logits + per_column.gather(-1, column.expand(*per_column.shape[:2], -1, -1))
    blocked = torch.zeros(q.size(0), 1, queries, keys, dtype=torch.bool)
    if causal:
        blocked = blocked | (j > i + keys - queries)
    if padding is not None:
        blocked = blocked | padding[:, None, None, :]
    probs = torch.softmax(logits.masked_fill(blocked, blocked_fill_value(q.dtype)), -1)
    if keep is not None:
        probs = probs * keep / (1 - dropout_p)
    out = probs @ v
    if values is not None:
        out = out + torch.einsum("bhij,hijd->bhid", probs, values[:, column].expand(q.size(1), -1, -1, -1))
    return out


def inputs(batch, heads, queries, keys, dims, dtype, term="bias", seed=0, rows=None):
    """q, qr, k, v, bias, vectors, values, grad_out (None where `term` has none); the tables of `rows`
    rows (None: one per distance column)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)
    q, qr = randn(batch, heads, queries, dims), randn(batch, heads, queries, dims)
    k, v = randn(batch, heads, keys, dims), randn(batch, heads, keys, dims)
    columns = queries + keys - 1 if rows is None else rows
    bias = randn(heads, columns) if "bias" in term else None
    vectors = values = None
    table_heads = 1 if "shared" in term else heads
    if "vectors" in term:
        vectors = randn(table_heads, columns, dims) / dims ** 0.5
    else:
        qr = None
    if "values" in term:
        values = randn(table_heads, columns, dims)
    return q, qr, k, v, bias, vectors, values, randn(batch, heads, queries, dims)


def compare(device, batch, heads, queries, keys, dims, causal, padding, term="bias", table_grad=True,
            dtype=torch.float64, dropout_p=0.0, window=None):
    """The kernel in `dtype` (float64: float32 on CUDA; the tables in float32 for half precision, as a
    model's) against `formula` in float64: output and gradients within the device's bound. With
    dropout, the formula takes the kernel's mask: the seed it draws from torch's generator, drawn
    again here from the same state (`dropout_keep`). `window`: (first column, rows) of the tables
    (None: a row per column)."""
    first_column, rows = window if window is not None else (0, None)
    *values, grad_out = inputs(batch, heads, queries, keys, dims, torch.float64, term, rows=rows)
    keep = None
    if dropout_p > 0:
        torch.manual_seed(1)
        seed = torch.randint(2 ** 62, (1,), device=device)
        keep = fused._kernels().dropout_keep(seed, batch, heads, queries, keys, dropout_p).cpu()
        torch.manual_seed(1)
    tables = {4, 5, 6}  # bias, vectors, values

    def prepared(dtype_of, where):
        return [None if x is None else x.to(where, dtype_of(n)).requires_grad_(n not in tables or table_grad)
                for n, x in enumerate(values)]
    expected_inputs = prepared(lambda n: torch.float64, "cpu")
    expected = formula(*expected_inputs, padding, causal, keep, dropout_p, first_column)
    wanted = [x for x in expected_inputs if x is not None and x.requires_grad]
    expected_grads = torch.autograd.grad(expected, wanted, grad_out)
    kernel_dtype = torch.float32 if dtype == torch.float64 and device.type != "cpu" else dtype
    limit = bound(device, "triton vs formula", kernel_dtype)
    half = kernel_dtype in (torch.float16, torch.bfloat16)
    got_inputs = prepared(lambda n: torch.float32 if half and n in tables else kernel_dtype, device)
    got = fused.TritonAttention.apply(*got_inputs, padding.to(device) if padding is not None else None, causal,
                                      dropout_p, first_column)
    got_wanted = [x for x in got_inputs if x is not None and x.requires_grad]
    got_grads = torch.autograd.grad(got, got_wanted, grad_out.to(device, kernel_dtype))
    assert (got.cpu().double() - expected).abs().max() <= limit * (1 + expected.abs().max())
    for a, b in zip(got_grads, expected_grads):
        assert a.shape == b.shape
        assert (a.cpu().double() - b).abs().max() <= limit * (1 + b.abs().max())
    return got


SHAPES = [  # (batch, heads, queries, keys, head dims): one tile; several, with ragged ends; fewer queries
    (2, 2, 5, 5, 8), (1, 2, 37, 37, 16), (1, 2, 7, 40, 24), (2, 1, 33, 33, 64)]


@pytest.mark.parametrize("term", TERMS)
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_output_and_gradients_equal_the_formula(kernel_device, shape, causal, term):
    compare(kernel_device, *shape, causal=causal, padding=None, term=term)


#: (shape, (first column, rows)): Shaw's k = 3 (rows for the distances -3..3); fewer queries than keys,
#: the window off the middle (LFHC's floor(x / l) at a later layer is not symmetric)
WINDOWS = [((1, 2, 70, 70, 16), (66, 7)), ((2, 1, 20, 75, 8), (30, 12))]


@pytest.mark.parametrize("term", TERMS)
@pytest.mark.parametrize("shape,window", WINDOWS, ids=["square", "off-centre"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_tables_whose_ends_stand_for_the_distances_beyond(kernel_device, shape, window, causal, term):
    """Tables for a window of distance columns, their first and last rows standing for every column
    before and after (Shaw and LFHC clip): the tiles wholly at an end take the kernels' end path
    (one number per query, the tables' gradients summed per row by the queries' kernel), the others
    the bands, and together they give the formula's output and gradients."""
    kernels = fused._kernels()
    block = kernels.settings(torch.float32, shape[-1], kernel_device.type == "cuda", "vectors" in term)["BLOCK"]
    query_blocks, key_blocks = -(-shape[2] // block), -(-shape[3] // block)
    near = kernels.near_diagonals(query_blocks, key_blocks, block, shape[2], *window)
    if block == 16:  # (the interpreter's tiles; CUDA's larger ones leave some of these cases no end)
        assert 0 < len(near) and near.start > 0 and near.stop < query_blocks + key_blocks - 1  # both ends
    compare(kernel_device, *shape, causal=causal, padding=None, term=term, window=window)


def test_clipped_tables_with_padding_and_dropout(kernel_device):
    """The end path with padded keys, rows that see no key and attention dropout."""
    padding = torch.zeros(3, 50, dtype=torch.bool)
    padding[0, -9:] = True
    padding[1, :] = True
    padding[2, :30] = True
    got = compare(kernel_device, 3, 2, 50, 50, 16, causal=True, padding=padding, term=TERMS[2], dropout_p=0.3,
                  window=(45, 9))
    assert torch.isfinite(got).all()


def test_tables_outside_the_distance_columns_are_refused():
    kernels = fused._kernels()
    table = torch.zeros(2, 5)
    for first_column, bias in ((-1, table), (6, table), (0, torch.zeros(2, 10))):
        with pytest.raises(ValueError, match="outside the 9 columns"):
            kernels.table_rows(4, 6, bias, None, None, first_column)
    with pytest.raises(ValueError, match="different numbers of rows"):
        kernels.table_rows(4, 6, table, torch.zeros(1, 4, 8), None, 0)


@pytest.mark.parametrize("term", ["bias", "shared vectors and values"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_padding_and_rows_that_see_no_key(kernel_device, causal, term):
    """Padded keys; a sentence all padding and a left-padded causal row's first queries see no key:
    uniform weights over all Tk keys there (the explicit path's answer, though the kernel skips the
    future tiles), and q, k and the tables get no gradient from such rows."""
    batch, queries = 3, 35
    padding = torch.zeros(batch, queries, dtype=torch.bool)
    padding[0, -4:] = True
    padding[1, :] = True
    padding[2, :20] = True  # left padding: under the causal mask queries 0..19 see only padding
    got = compare(kernel_device, batch, 2, queries, queries, 16, causal=causal, padding=padding, term=term)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("causal,term", [(False, "bias"), (True, "bias and vectors and values")])
def test_blocks_of_keys_all_padding_are_never_read(kernel_device, causal, term):
    """The kernels skip a block of keys that is all padding: NaN keys and values there change no
    output or gradient, and those keys' gradients are zero (a kernel that read them would spread the
    NaN, as 0 * NaN is NaN)."""
    dims = 16
    settings = fused._kernels().settings(torch.float32, dims, kernel_device.type == "cuda", "vectors" in term)
    block, keys = settings["BLOCK"], 3 * settings["BLOCK"] + 5
    padding = torch.zeros(2, keys, dtype=torch.bool)
    padding[0, block + 2:] = True  # right padding: blocks 2 and 3 all padding
    if causal:  # (left padding would leave the first queries without a key, whose uniform rows read v)
        padding[1, 2 * block + 1:] = True
    else:
        padding[1, :2 * block + 3] = True  # left padding: blocks 0 and 1
    unread = torch.zeros_like(padding)
    for start in range(0, keys, block):
        unread[:, start:start + block] = padding[:, start:start + block].all(-1, keepdim=True)
    assert unread[0].any() and unread[1].any()
    *tensors, grad_out = inputs(2, 2, keys, keys, dims, torch.float64, term)
    leaves = [x.requires_grad_() if x is not None else None for x in tensors]
    expected = formula(*leaves, padding, causal)
    expected_grads = torch.autograd.grad(expected, [x for x in leaves if x is not None], grad_out)
    got_leaves = [x.detach().to(kernel_device, torch.float32) if x is not None else None for x in tensors]
    for index in (2, 3):  # k, v
        got_leaves[index] = got_leaves[index].masked_fill(unread.to(kernel_device)[:, None, :, None], float("nan"))
    got_leaves = [x.requires_grad_() if x is not None else None for x in got_leaves]
    got = fused.TritonAttention.apply(*got_leaves, padding.to(kernel_device), causal)
    got_grads = torch.autograd.grad(got, [x for x in got_leaves if x is not None], grad_out.to(kernel_device, torch.float32))
    limit = bound(kernel_device, "triton vs formula", torch.float32)
    for a, b in zip((got, *got_grads), (expected, *expected_grads)):
        assert (a.cpu().double() - b).abs().max() <= limit * (1 + b.abs().max())


@pytest.mark.parametrize("causal,term", [(False, TERMS[0]), (True, TERMS[1]), (True, TERMS[2])])
def test_attention_dropout_equals_the_formula_with_the_kernels_mask(kernel_device, causal, term):
    """Dropout inside the kernels: the output and every gradient are the formula's with the mask the
    kernels draw (the same in forward and in each backward kernel), over padded keys, rows that see no
    key (a sentence all padding; left padding under the causal mask) and ragged tiles."""
    padding = torch.zeros(3, 37, dtype=torch.bool)
    padding[0, -5:] = True
    padding[1, :] = True
    padding[2, :20] = True
    got = compare(kernel_device, 3, 2, 37, 37, 16, causal=causal, padding=padding, term=term, dropout_p=0.3)
    assert torch.isfinite(got).all()


def test_the_dropout_mask_keeps_1_minus_p_independently_per_pair(kernel_device):
    """The kernels' draws: kept at the rate 1 - p, heads and rows not alike, another seed another mask
    (200,704 draws: the rate's standard error is 7e-4)."""
    kernels = fused._kernels()
    seeds = [torch.tensor([seed], device=kernel_device) for seed in (12345, 2 ** 61 + 7)]
    keep, other = (kernels.dropout_keep(seed, 2, 3, 64, 522, 0.25).cpu() for seed in seeds)
    assert abs(keep.double().mean().item() - 0.75) < 0.005
    disagree = 2 * 0.25 * 0.75  # P(two independent draws differ)
    for a, b in ((keep[:, 0], keep[:, 1]), (keep[0], keep[1]), (keep[..., :32, :], keep[..., 32:, :]), (keep, other)):
        assert abs((a != b).double().mean().item() - disagree) < 0.01


def test_tables_without_gradient(kernel_device):
    """ALiBi's slopes are fixed; frozen tables: no gradient asked for them."""
    padding = torch.zeros(2, 20, dtype=torch.bool)
    padding[1, 15:] = True
    compare(kernel_device, 2, 2, 20, 20, 8, causal=True, padding=padding, term="bias and vectors and values",
            table_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("term,window", [("bias", None), ("bias and vectors and values", None),
                                         ("bias and vectors and values", (30, 9))],
                         ids=["bias", "bias and vectors and values", "clipped tables"])
def test_float32_and_half_precision(kernel_device, dtype, term, window):
    """(Clipped tables: the tiles at their ends round their term as the bands do.)"""
    padding = torch.zeros(2, 37, dtype=torch.bool)
    padding[0, 30:] = True
    compare(kernel_device, 2, 3, 37, 37, 16, causal=True, padding=padding, term=term, dtype=dtype, window=window)


def test_the_tables_gradients_are_the_same_on_every_run(kernel_device):
    """No atomics: the sums per distance are added in a fixed order."""
    if kernel_device.type == "cpu":
        pytest.skip("the interpreter runs the programs one after another: only a GPU can reorder them")
    *values, grad_out = (x.to(kernel_device, torch.float32) if x is not None else None
                         for x in inputs(2, 2, 40, 40, 16, torch.float64, "bias and vectors and values"))
    results = []
    for _ in range(2):
        q, qr, k, v, *tables = values
        tables = [table.clone().requires_grad_() for table in tables]
        fused.TritonAttention.apply(q, qr, k, v, *tables, None, True).backward(grad_out)
        results.append([table.grad for table in tables])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("capability,dtypes", [(90, ["bf16", "fp32"]), (80, ["bf16"])])
def test_the_kernels_compile_for_nvidia_gpus(capability, dtypes):
    """Down to the cubin (Triton's ptxas, no GPU needed) for the H100 (sm_90) and the A100 (sm_80),
    with and without vectors: what the interpreter does not check (types, layouts), and shared memory
    within what one block may have there."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    script = Path(__file__).with_name("compile_triton.py")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), str(capability), *dtypes], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 8 * len(dtypes)
    shared_limit = {90: 227 * 1024, 80: 163 * 1024}[capability]
    assert all(int(line[-1]) <= shared_limit for line in lines), lines


def test_mode_is_interpreted_under_the_interpreter(monkeypatch):
    """The plan stays a function of the call: where Triton's interpreter is on, `mode()` says so,
    and only then do CPU tensors take the kernel."""
    monkeypatch.setenv(fused.SWITCH, "on")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.mode() == fused.INTERPRETED
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fused.mode() == "on"
    q = torch.zeros(1, 1, 2, 4)
    for query_dependent in (False, True):
        assert fused.available(q, fused.INTERPRETED, query_dependent)
        assert not any(fused.available(q, mode, query_dependent) for mode in ("on", "auto", "off"))


def test_auto_takes_the_kernel_for_terms_that_depend_on_the_query_on_capable_gpus(monkeypatch):
    """The default, "auto": on a GPU of compute capability 8.0 or later with `triton`, the kernel serves
    Shaw, LFHC, XL and GCDF's calls and not the bias-only ones, in fp32/fp16/bf16 (not float64); "on"
    serves both, "off" neither; on an older GPU "auto" serves none. (A stand-in for CUDA queries: `available` reads their device.)"""
    from types import SimpleNamespace

    gpu = SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.bfloat16)
    capabilities = {"cuda:0": (9, 0)}
    monkeypatch.setattr(fused.torch.cuda, "get_device_capability", lambda device: capabilities[device])
    monkeypatch.setattr(fused, "TRITON_INSTALLED", True)
    assert fused.available(gpu, "auto", True) and not fused.available(gpu, "auto", False)
    assert fused.available(gpu, "on", True) and fused.available(gpu, "on", False)
    assert not fused.available(gpu, "off", True)
    assert not fused.available(SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.float64), "auto", True)
    capabilities["cuda:0"] = (7, 5)
    assert not fused.available(gpu, "auto", True) and fused.available(gpu, "on", True)
    capabilities["cuda:0"] = (9, 0)
    monkeypatch.setattr(fused, "TRITON_INSTALLED", False)  # auto: the other paths; on: refused when called
    assert not fused.available(gpu, "auto", True) and fused.available(gpu, "on", True)


def test_switch_values(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(fused.SWITCH, "yes")
    with pytest.raises(ValueError, match="POSENC_TRITON_ATTENTION='yes'"):
        fused.mode()
    monkeypatch.setenv(fused.SWITCH, "on")
    assert fused.mode() == "on"
    monkeypatch.setenv(fused.SWITCH, "off")
    assert fused.mode() == "off"
    monkeypatch.delenv(fused.SWITCH)
    assert fused.mode() == "auto"


def test_without_triton_the_switch_is_refused_with_the_way_out(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "posenc_fairseq.kernels.triton_kernels", None)  # (import fails)
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="needs the `triton` package.*unset POSENC_TRITON_ATTENTION.*auto"):
        fused.TritonAttention.apply(q, None, q, q, torch.zeros(1, 3), None, None, None, False)
