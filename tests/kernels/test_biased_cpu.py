"""kernels/biased_cpu.py: the fused CPU forward with a hand-written blockwise backward, against
autograd of the explicit formula softmax(q k^T + A) v (whole models: tests/models/test_fused_training.py)."""
import pytest
import torch

from posenc_fairseq.kernels import biased_cpu as biased
from posenc_fairseq.kernels.masks import blocked_fill_value

B, H, D = 2, 3, 8
LARGE = biased.MIN_LOGITS


def explicit(q, k, v, additive, blocked=None):
    """The explicit path's formula: blocked logits filled (no gradient through them), so a row that
    sees no key weighs every key alike whatever q, k and A, and gives them no gradient."""
    logits = q @ k.transpose(-1, -2) + additive
    if blocked is not None:
        logits = logits.masked_fill(blocked, blocked_fill_value(logits.dtype))
    return torch.softmax(logits, dim=-1) @ v


def compare(q_len, k_len, shape, blocked=None, needs=(True, True, True, True), seed=0, future_blocked=False):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=generator) for n in (q_len, k_len, k_len))
    additive = torch.randn(*shape, generator=generator)
    if blocked is not None:
        additive = additive.expand(B, H, q_len, k_len).masked_fill(blocked, blocked_fill_value(torch.float32))
    inputs = [x.clone().requires_grad_(need) for x, need in zip((q, k, v, additive), needs)]
    grad_out = torch.randn(B, H, q_len, D, generator=generator)
    wanted = [x for x in inputs if x.requires_grad]
    expected_out = explicit(*inputs, blocked)
    expected = torch.autograd.grad(expected_out, wanted, grad_out)
    out = biased.attend(*inputs, future_blocked=future_blocked)
    got = torch.autograd.grad(out, wanted, grad_out)
    assert (out - expected_out).abs().max() < 1e-5
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert (a - b).abs().max() < 1e-5 * (1 + b.abs().max())


@pytest.mark.parametrize("shape", [(B, H, 9, 11), (1, H, 9, 11), (H, 9, 11), (9, 11), (B, 1, 1, 11), (1, H, 1, 11)])
@pytest.mark.parametrize("block_elements", [biased.BLOCK_ELEMENTS, 1])  # one block, or MIN_BLOCK_ROWS rows
def test_values_and_gradients_equal_the_explicit_formula(monkeypatch, shape, block_elements):
    monkeypatch.setattr(biased, "BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr(biased, "MIN_BLOCK_ROWS", 2)
    compare(9, 11, shape)


def test_blocked_keys_padding_and_a_fully_blocked_row():
    blocked = torch.zeros(B, H, 6, 6, dtype=torch.bool)
    blocked[..., 4:] = True  # padding keys
    blocked[0, :, 2, :] = True  # a row that sees no key: uniform weights, as the explicit softmax gives
    blocked = blocked | torch.ones(6, 6, dtype=torch.bool).triu(1)  # and the future
    compare(6, 6, (1, H, 6, 6), blocked=blocked)


def test_a_row_that_sees_no_key_passes_no_gradient_to_q_k_or_the_term():
    """Its output is the mean of v whatever q, k and A: only v gets a gradient (1/Tk of the row's)."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 4, 3, generator=generator).requires_grad_() for _ in range(3))
    blocked = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    blocked[..., 1, :] = True
    additive = torch.randn(1, 1, 4, 4, generator=generator).masked_fill(blocked, blocked_fill_value(torch.float32))
    additive.requires_grad_()
    grad_out = torch.zeros(1, 1, 4, 3)
    grad_out[..., 1, :] = 1.0  # through that row alone
    out = biased.attend(q, k, v, additive)
    assert torch.allclose(out[0, 0, 1], v[0, 0].mean(0).detach(), atol=1e-6)
    grad_q, grad_k, grad_v, grad_additive = torch.autograd.grad(out, (q, k, v, additive), grad_out)
    assert grad_q.abs().max() == 0 and grad_k.abs().max() == 0 and grad_additive.abs().max() == 0
    assert torch.allclose(grad_v, torch.full_like(grad_v, 1 / 4))


def future(q_len, k_len):
    """(q_len, k_len) True after each query, the queries being the last q_len of the keys."""
    return torch.ones(q_len, k_len, dtype=torch.bool).triu(k_len - q_len + 1)


@pytest.mark.parametrize("q_len, k_len", [(13, 13), (7, 13)])  # (7, 13): one block of queries of a longer input
@pytest.mark.parametrize("block_elements", [biased.BLOCK_ELEMENTS, 1])
def test_future_blocked_skips_the_future_keys_with_the_same_result(monkeypatch, q_len, k_len, block_elements):
    """The causal flag lets the forward skip the future keys' tiles and each backward block the keys
    after its last query; every gradient stays the explicit formula's (the term's too: zero there)."""
    monkeypatch.setattr(biased, "BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr(biased, "MIN_BLOCK_ROWS", 3)
    blocked = future(q_len, k_len).expand(B, H, q_len, k_len).clone()
    blocked[..., 0] = True  # a padded first key: every row still sees a key
    compare(q_len, k_len, (1, H, q_len, k_len), blocked=blocked, future_blocked=True)
    blocked[1, :, 0, :] = True  # ...and a row that sees no key: both passes run over every key
    compare(q_len, k_len, (1, H, q_len, k_len), blocked=blocked, future_blocked=True)


@pytest.mark.parametrize("q_len, k_len", [(13, 13), (7, 13)])
def test_future_blocked_with_no_padding_sees_every_key_up_to_its_query(q_len, k_len):
    """The kernel's causal flag aligns queries and keys at the start, so it stands for the future
    mask only where Tq == Tk; the last Tq of more keys (a block of queries of a longer input) see
    the keys up to their own position. With no padded key every row sees a key, so nothing runs the
    call again without the flag (as a padded first key does in the test above)."""
    blocked = future(q_len, k_len).expand(B, H, q_len, k_len)
    compare(q_len, k_len, (1, H, q_len, k_len), blocked=blocked, future_blocked=True)


def test_future_blocked_skips_work(monkeypatch):
    """The backward's products cover the keys up to each block's last query only."""
    monkeypatch.setattr(biased, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(biased, "MIN_BLOCK_ROWS", 4)
    widths = []
    original = torch.matmul

    def recording(a, b, **kwargs):
        widths.append(b.size(-1))
        return original(a, b, **kwargs)

    q, k, v = (torch.randn(1, H, 12, D, requires_grad=True) for _ in range(3))
    term = torch.randn(1, H, 12, 12).masked_fill(future(12, 12), blocked_fill_value(torch.float32))
    out = biased.attend(q, k, v, term.requires_grad_(), future_blocked=True)
    monkeypatch.setattr(torch, "matmul", recording)
    out.sum().backward()
    assert widths[0::3] == [4, 8, 12]  # the logits of each block of 4 queries


@pytest.mark.parametrize("needs", [(False, False, False, True), (True, False, True, True), (True, True, True, False)])
def test_only_the_asked_gradients(needs):
    compare(5, 7, (B, H, 5, 7), needs=needs)


def test_serves_only_where_the_fused_kernel_computes_the_same():
    q = torch.randn(1, 2, 3, 4)
    assert biased.serves_call(q, 0.0, LARGE, grad_enabled=True)
    assert not biased.serves_call(q, 0.0, biased.MIN_LOGITS - 1, True)  # (small calls: the explicit softmax)
    assert not biased.serves_call(q, 0.1, LARGE, True)  # (the kernel has no attention dropout)
    assert not biased.serves_call(q.bfloat16(), 0.0, LARGE, True)
    assert not biased.serves_call(q.double(), 0.0, LARGE, True)
    assert not biased.serves_call(q, 0.0, LARGE, grad_enabled=False)  # (no gradient: SDPA's fused kernel itself)