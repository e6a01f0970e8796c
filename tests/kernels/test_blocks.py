"""Long inputs: PositionalAttention computes the relative terms of Shaw, LFHC, XL and GCDF one block
of queries at a time (`QUERY_BLOCK`). Blocked and whole calls must agree in the output and in every
gradient, with padding, the causal mask, --cross-self-attention's source keys and head pruning."""
import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.kernels import blocks as block_module
from posenc_fairseq.kernels import terms as terms_module
from posenc_fairseq.encodings import ModelDims
from util import bound_attention, perturbed_encoding

EMBED, HEADS = 16, 4
CASES = [("shaw", ["--shaw-k", "3"]), ("lfhc", ["--lfhc-k", "2", "--lfhc-values", "on"]), ("lfhc", ["--lfhc-k", "2"]),
         ("xl", []), ("gcdf", [])]


def blocks(monkeypatch, size):
    monkeypatch.setattr(block_module, "QUERY_BLOCK", size)
    monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)


def run_both(monkeypatch, enc, call, queries, size=4):
    """call() -> (output, tensors whose .grad to compare); whole first, then in blocks of `size`
    (checked: the dense relative terms are made once per block, and once more per block when
    backward recomputes it)."""
    results = []
    calls = []
    original = terms_module.dense_logits

    def counted(term, query, *rest, **options):
        calls.append(query.size(2))
        return original(term, query, *rest, **options)

    for block in (None, size):
        monkeypatch.undo()
        monkeypatch.setattr(terms_module, "dense_logits", counted)
        if block is not None:
            blocks(monkeypatch, block)
        calls.clear()
        out, tensors = call()
        expected = [queries] if block is None else [min(size, queries - start) for start in range(0, queries, size)]
        assert calls == expected
        calls.clear()
        out.pow(2).sum().backward()
        assert sorted(calls) == ([] if block is None else sorted(expected))
        results.append((out.detach(), [t.grad.clone() if t.grad is not None else None for t in tensors]))
        for t in tensors:
            t.grad = None
    monkeypatch.undo()
    (whole, whole_grads), (blocked, blocked_grads) = results
    assert (whole - blocked).abs().max() <= 1e-10
    assert sum(a is not None for a in whole_grads) > 3
    for a, b in zip(whole_grads, blocked_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("name,argv", CASES)
@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("padded", ["right", "left", "left, the stack's mask"])
def test_blocked_equals_whole_with_gradients(monkeypatch, name, argv, role, padded):
    """Left padding under the future mask leaves the first queries no key: each weighs every key of
    the call alike (and passes no gradient to q, k or the terms), in blocks as in the whole call."""
    enc = perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, 3, 3))
    module = bound_attention(enc, role, 2, EMBED, HEADS)
    length, batch = 11, 2
    torch.manual_seed(4)
    x = torch.randn(length, batch, EMBED, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    if padded == "right":
        padding[1, -3:] = True
    else:
        padding[1, :6] = True  # (under the future mask: queries 0-5 of row 1, across two blocks, see no key)
    mask = torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1) if role == "decoder" else None

    def call():
        enc.begin(role)
        if padded.endswith("mask") and mask is not None:
            enc.contexts["decoder"].future_mask = mask  # (known to block exactly the future, not read)
        out, _ = module(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=False)
        return out, [x, *enc.parameters(), *module.parameters()]

    run_both(monkeypatch, enc, call, length)


@pytest.mark.parametrize("name,argv", CASES)
def test_blocked_equals_whole_with_source_keys_and_pruned_heads(monkeypatch, name, argv):
    """--cross-self-attention (keys cat(source, target), no term towards the source keys) after
    head pruning (each kept head keeps its own terms)."""
    from fairseq.modules import MultiheadAttention

    from posenc_fairseq.attention import use_positional_attention

    enc = perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, 1, 1))
    torch.manual_seed(0)
    module = MultiheadAttention(EMBED, HEADS, encoder_decoder_attention=False, self_attention=False)
    use_positional_attention(module)
    module.bind_position(enc, "decoder", 0)
    module = module.double().eval()
    module._adaptive_prune_heads([(2 * module.head_dim, 3 * module.head_dim), (0, module.head_dim)])
    source_len, target_len, batch = 4, 9, 2
    torch.manual_seed(5)
    memory = torch.randn(source_len, batch, EMBED, dtype=torch.float64)
    x = torch.randn(target_len, batch, EMBED, dtype=torch.float64, requires_grad=True)
    causal = torch.triu(torch.full((target_len, target_len), float("-inf"), dtype=torch.float64), 1)
    attn_mask = torch.cat([torch.zeros(target_len, source_len, dtype=torch.float64), causal], dim=1)

    def call():
        enc.begin("decoder", torch.arange(target_len).expand(batch, target_len),
                  torch.arange(source_len).expand(batch, source_len))
        keys = torch.cat([memory, x])
        out, _ = module(x, keys, keys, attn_mask=attn_mask, need_weights=False)
        return out, [x, *enc.parameters(), *module.parameters()]

    run_both(monkeypatch, enc, call, target_len, size=2)


def test_block_size():
    assert block_module.query_block_size(4, 1024) == 256  # 2^20 elements a block
    assert block_module.query_block_size(64, 4096) == block_module.QUERY_BLOCK
    assert block_module.query_block_size(8, 64) == 2 ** 20 // 512  # short keys: one piece


@pytest.mark.parametrize("name,argv", CASES)
def test_blocked_training_keeps_only_block_inputs(monkeypatch, name, argv):
    """What a blocked training call keeps for backward: its inputs, not the (B, H, n, n)
    probabilities and relative terms the whole call keeps (counted through autograd's
    saved-tensor hooks, which see what the graph holds outside the recomputed blocks)."""
    enc = perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, 1, 1))
    module = bound_attention(enc, "encoder", 0, EMBED, HEADS).train()
    length, batch = 64, 2
    x = torch.randn(length, batch, EMBED, dtype=torch.float64, requires_grad=True)

    def saved_elements():
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            enc.begin("encoder")
            module(x, x, x, need_weights=False)
        return sum(sizes), max(sizes)

    whole_total, whole_largest = saved_elements()
    blocks(monkeypatch, 8)
    blocked_total, blocked_largest = saved_elements()
    assert whole_largest >= batch * HEADS * length * length  # the probabilities (and relative terms)
    assert blocked_largest < batch * HEADS * 8 * length  # nothing as large as one block's logits
    assert blocked_total * 4 < whole_total


@pytest.mark.parametrize("name,argv", CASES)
def test_recomputed_blocks_drop_the_same_attention(monkeypatch, name, argv):
    """Training with attention dropout: backward recomputes each block with the dropout mask of
    its forward (the same outputs and gradients as keeping every block's graph)."""
    enc = perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, 1, 1))
    module = bound_attention(enc, "decoder", 0, EMBED, HEADS).train()
    module.dropout_module.p = 0.3
    length, batch = 13, 2
    x = torch.randn(length, batch, EMBED, dtype=torch.float64, requires_grad=True)
    mask = torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1)
    blocks(monkeypatch, 4)
    results = []
    for keep_graphs in (False, True):
        if keep_graphs:
            monkeypatch.setattr(block_module, "checkpoint", lambda function, *args, **_: function(*args))
        torch.manual_seed(7)
        enc.begin("decoder")
        out, _ = module(x, x, x, attn_mask=mask, need_weights=False)
        torch.manual_seed(8)  # backward must not depend on the RNG state it starts from
        out.pow(2).sum().backward()
        tensors = [x, *enc.parameters(), *module.parameters()]
        results.append((out.detach(), [t.grad.clone() for t in tensors if t.grad is not None]))
        for t in tensors:
            t.grad = None
    (recomputed, recomputed_grads), (kept, kept_grads) = results
    assert (recomputed - kept).abs().max() <= 1e-12
    assert len(recomputed_grads) == len(kept_grads) > 3
    for a, b in zip(recomputed_grads, kept_grads):
        assert (a - b).abs().max() <= 1e-12
    enc.begin("decoder")
    torch.manual_seed(9)
    other, _ = module(x, x, x, attn_mask=mask, need_weights=False)
    assert (other - kept).abs().max() > 1e-3  # dropout really drops
