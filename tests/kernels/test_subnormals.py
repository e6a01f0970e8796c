"""A backward that raises between an attention's output and its q.k leaves the thread's
subnormal flushing as it found it (posenc_fairseq/kernels/subnormals.py)."""
import gc

import pytest
import torch

from posenc_fairseq.kernels.subnormals import _flushing_subnormals, flush_subnormals_in_backward


def attention(query):
    """A tiny attention whose backward runs with flushing on, and a hook inside it that raises."""
    key, value = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    products = query @ key.transpose(-1, -2)
    probs = products.softmax(-1)

    def failing(_):
        raise RuntimeError("raised inside the attention's backward")

    probs.register_hook(failing)
    out = probs @ value
    flush_subnormals_in_backward(out, products)
    return out


@pytest.fixture
def not_flushing():
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)


def test_switched_off_when_the_failed_backwards_graph_is_freed(not_flushing):
    out = attention(torch.randn(1, 1, 4, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match="inside the attention's backward"):
        out.sum().backward()
    del out
    gc.collect()
    assert not _flushing_subnormals()


def test_switched_off_at_the_next_forward_while_the_graph_is_kept(not_flushing):
    query = torch.randn(1, 1, 4, 8, requires_grad=True)
    out = attention(query)
    with pytest.raises(RuntimeError, match="inside the attention's backward"):
        out.sum().backward()
    products = query @ query.transpose(-1, -2)  # the next attention's forward, `out` still alive
    flush_subnormals_in_backward(products.softmax(-1), products)
    assert not _flushing_subnormals()
    assert out.grad_fn is not None


def test_kept_on_for_a_forward_recomputed_inside_the_same_backward(not_flushing):
    """Activation checkpointing recomputes a layer's forward inside the backward pass that switched
    flushing on: that forward must not switch it off for the rest of the attention's backward."""
    query = torch.randn(1, 1, 4, 8, requires_grad=True)
    key, value = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    products = query @ key.transpose(-1, -2)
    probs = products.softmax(-1)
    seen = []

    def recompute(grad):
        with torch.enable_grad():  # as torch.utils.checkpoint recomputes
            inner = query.detach().requires_grad_() @ key.transpose(-1, -2)
            flush_subnormals_in_backward(inner.softmax(-1), inner)
        seen.append(_flushing_subnormals())
        return grad

    probs.register_hook(recompute)
    out = probs @ value
    flush_subnormals_in_backward(out, products)
    out.sum().backward()
    assert seen == [True]
    assert not _flushing_subnormals()


def test_a_thread_that_flushed_already_keeps_flushing(not_flushing):
    torch.set_flush_denormal(True)
    out = attention(torch.randn(1, 1, 4, 8, requires_grad=True))
    with pytest.raises(RuntimeError):
        out.sum().backward()
    del out
    gc.collect()
    assert _flushing_subnormals()
