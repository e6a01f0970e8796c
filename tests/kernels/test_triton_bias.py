"""kernels/triton_bias.py and its Triton kernels (triton_kernels.py): the output and every gradient,
the bias table's included, against the formula written out in float64 (a naive softmax over the
(Tq, Tk) logits). On CPU the kernels run in Triton's interpreter (tests/conftest.py sets it); with
--device cuda, compiled (the `kernel_device` fixture). Whole models: tests/models/test_triton_training.py."""
import os

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.kernels import triton_bias as fused
from posenc_fairseq.kernels.masks import blocked_fill_value
from devices import bound


def formula(q, k, v, bias, padding, causal):
    """softmax(q k^T + bias[h, j - i + Tq - 1], blocked logits at the dtype's finite minimum) v."""
    queries, keys = q.size(2), k.size(2)
    i, j = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
    logits = q @ k.transpose(-1, -2)
    if bias is not None:
        logits = logits + bias[:, j - i + queries - 1]
    blocked = torch.zeros(q.size(0), 1, queries, keys, dtype=torch.bool)
    if causal:
        blocked = blocked | (j > i + keys - queries)
    if padding is not None:
        blocked = blocked | padding[:, None, None, :]
    return torch.softmax(logits.masked_fill(blocked, blocked_fill_value(q.dtype)), -1) @ v


def inputs(batch, heads, queries, keys, dims, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, dims, generator=generator, dtype=dtype) for n in (queries, keys, keys))
    bias = torch.randn(heads, queries + keys - 1, generator=generator, dtype=dtype)
    grad_out = torch.randn(batch, heads, queries, dims, generator=generator, dtype=dtype)
    return q, k, v, bias, grad_out


def compare(device, batch, heads, queries, keys, dims, causal, padding, bias_grad=True, dtype=torch.float64):
    """The kernel in `dtype` (float64: float32 on CUDA; the bias in float32 for half precision, as a
    model's table) against `formula` in float64: output and gradients within the device's bound."""
    q, k, v, bias, grad_out = inputs(batch, heads, queries, keys, dims, dtype)
    expected_inputs = [x.clone().requires_grad_(x is not bias or bias_grad) for x in (q, k, v, bias)]
    expected = formula(*expected_inputs, padding, causal)
    wanted = [x for x in expected_inputs if x.requires_grad]
    expected_grads = torch.autograd.grad(expected, wanted, grad_out)
    kernel_dtype = torch.float32 if dtype == torch.float64 and device.type != "cpu" else dtype
    limit = bound(device, "triton vs formula", kernel_dtype)
    bias_dtype = torch.float32 if kernel_dtype in (torch.float16, torch.bfloat16) else kernel_dtype
    got_inputs = [x.to(device, kernel_dtype if x is not bias else bias_dtype).requires_grad_(x is not bias or bias_grad)
                  for x in (q, k, v, bias)]
    got = fused.TritonBiasAttention.apply(*got_inputs, padding.to(device) if padding is not None else None, causal)
    got_wanted = [x for x in got_inputs if x.requires_grad]
    got_grads = torch.autograd.grad(got, got_wanted, grad_out.to(device, kernel_dtype))
    assert (got.cpu().double() - expected).abs().max() <= limit * (1 + expected.abs().max())
    for name, a, b in zip(["q", "k", "v", "bias"], got_grads, expected_grads):
        assert a.shape == b.shape, name
        assert (a.cpu().double() - b).abs().max() <= limit * (1 + b.abs().max()), name
    return got


SHAPES = [  # (batch, heads, queries, keys, head dims): one tile; several, with ragged ends; fewer queries
    (2, 2, 5, 5, 8), (2, 3, 37, 37, 16), (1, 2, 7, 40, 24), (2, 1, 33, 33, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_output_and_gradients_equal_the_formula(kernel_device, shape, causal):
    compare(kernel_device, *shape, causal=causal, padding=None)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_padding_and_rows_that_see_no_key(kernel_device, causal):
    """Padded keys; a sentence all padding and a left-padded causal row's first queries see no key:
    uniform weights over all Tk keys there (the explicit path's answer, though the kernel skips the
    future tiles), and q, k and the bias get no gradient from such rows."""
    batch, queries = 3, 35
    padding = torch.zeros(batch, queries, dtype=torch.bool)
    padding[0, -4:] = True
    padding[1, :] = True
    padding[2, :20] = True  # left padding: under the causal mask queries 0..19 see only padding
    got = compare(kernel_device, batch, 2, queries, queries, 16, causal=causal, padding=padding)
    assert torch.isfinite(got).all()


def test_a_bias_without_gradient(kernel_device):
    """ALiBi's slopes are fixed: no gradient asked for the bias."""
    padding = torch.zeros(2, 20, dtype=torch.bool)
    padding[1, 15:] = True
    compare(kernel_device, 2, 2, 20, 20, 8, causal=True, padding=padding, bias_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_float32_and_half_precision(kernel_device, dtype):
    padding = torch.zeros(2, 37, dtype=torch.bool)
    padding[0, 30:] = True
    compare(kernel_device, 2, 3, 37, 37, 16, causal=True, padding=padding, dtype=dtype)


def test_the_bias_gradient_is_the_same_on_every_run(kernel_device):
    """No atomics: the sums per distance are added in a fixed order."""
    q, k, v, bias, grad_out = (x.to(kernel_device, torch.float32) for x in inputs(2, 2, 40, 40, 16, torch.float64))
    results = []
    for _ in range(2):
        leaf = bias.clone().requires_grad_()
        fused.TritonBiasAttention.apply(q, k, v, leaf, None, True).backward(grad_out)
        results.append(leaf.grad)
    assert torch.equal(*results)


def test_switch_values(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(fused.SWITCH, "yes")
    with pytest.raises(ValueError, match="POSENC_TRITON_ATTENTION='yes'"):
        fused.mode()
    monkeypatch.setenv(fused.SWITCH, "on")
    assert fused.mode() == "on"
    monkeypatch.delenv(fused.SWITCH)
    assert fused.mode() == "off"


def test_without_triton_the_switch_is_refused_with_the_way_out(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "posenc_fairseq.kernels.triton_kernels", None)  # (import fails)
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="needs the `triton` package.*unset POSENC_TRITON_ATTENTION"):
        fused.TritonBiasAttention.apply(q, q, q, torch.zeros(1, 3), None, False)


@pytest.mark.parametrize("capability", [80, 90])
def test_the_kernels_compile_for_nvidia_gpus(capability):
    """Down to the cubin (Triton's ptxas, no GPU needed), in the dtypes that train: what the
    interpreter does not check (types, layouts, shared memory)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    script = Path(__file__).with_name("compile_triton.py")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), str(capability), "bf16", "fp32"], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines.count("bf16") == 3 and lines.count("fp32") == 3


def test_mode_is_interpreted_under_the_interpreter(monkeypatch):
    """The plan stays a function of the call: where Triton's interpreter is on, `mode()` says so,
    and only then do CPU tensors take the kernel."""
    monkeypatch.setenv(fused.SWITCH, "on")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.mode() == fused.INTERPRETED
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fused.mode() == "on"
    q = torch.zeros(1, 1, 2, 4)
    assert not fused.available(q, "on") and fused.available(q, fused.INTERPRETED) and not fused.available(q, "off")
