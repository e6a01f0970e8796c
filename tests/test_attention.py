"""PositionalAttention against fairseq's MultiheadAttention and against a naive formula."""
import pytest
import torch

import posenc_fairseq  # noqa: F401
from fairseq.modules import MultiheadAttention
from fairseq import utils
from posenc_fairseq.attention import use_positional_attention
from posenc_fairseq.encodings.base import ModelDims, PositionalEncoding

EMBED, HEADS = 16, 4


def pair(kind):
    torch.manual_seed(0)
    options = dict(self_attention=kind == "self", encoder_decoder_attention=kind == "cross")
    reference = MultiheadAttention(EMBED, HEADS, **options).eval()
    ours = MultiheadAttention(EMBED, HEADS, **options)
    ours.load_state_dict(reference.state_dict())
    use_positional_attention(ours)
    return reference, ours.eval()


def padding(batch, length, pad_rows=(0,)):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row in pad_rows:
        mask[row, -2:] = True  # right padding: no query row is fully masked (fairseq would give NaN)
    return mask


@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_fairseq(kind, need_weights, causal):
    reference, ours = pair(kind)
    x, memory = torch.randn(6, 3, EMBED), torch.randn(8, 3, EMBED)
    key = x if kind == "self" else memory
    mask = padding(3, key.size(0))
    attn_mask = utils.fill_with_neg_inf(torch.zeros(6, 6)).triu(1) if (causal and kind == "self") else None
    expected, expected_weights = reference(x, key, key, key_padding_mask=mask, attn_mask=attn_mask, need_weights=need_weights)
    got, weights = ours(x, key, key, key_padding_mask=mask, attn_mask=attn_mask, need_weights=need_weights)
    assert (expected - got).abs().max() <= 1e-5
    if need_weights:
        assert (expected_weights - weights).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_incremental_matches_fairseq(kind):
    reference, ours = pair(kind)
    x, memory = torch.randn(5, 2, EMBED), torch.randn(7, 2, EMBED)
    memory_mask = padding(2, 7)
    states = ({}, {})
    for step in range(5):
        outputs = []
        for module, state in zip((reference, ours), states):
            key = x[: step + 1] if kind == "self" else memory
            out, _ = module(x[step: step + 1], key if kind == "cross" else x[step: step + 1],
                            key if kind == "cross" else x[step: step + 1],
                            key_padding_mask=memory_mask if kind == "cross" else None,
                            incremental_state=state, static_kv=kind == "cross", need_weights=False)
            outputs.append(out)
        assert (outputs[0] - outputs[1]).abs().max() <= 1e-5


class ConstantBias(PositionalEncoding):
    """A test encoding: logit bias b[h, i, j] = (h + 1) * (j - i) / 10, and a q-projection shift."""

    def logit_bias(self, role, layer, query_positions, key_positions):
        heads = torch.arange(1, HEADS + 1, dtype=torch.float)[:, None, None]
        return heads * (key_positions[None, None, :] - query_positions[None, :, None]).float() / 10


def naive_attention(module, x, bias):
    """softmax(q k^T / sqrt(d) + bias) v, straight from the definition, one head at a time."""
    q = module.q_proj(x) * module.scaling
    k, v = module.k_proj(x), module.v_proj(x)
    outputs = []
    for h in range(HEADS):
        part = slice(h * module.head_dim, (h + 1) * module.head_dim)
        logits = torch.einsum("tbd,sbd->bts", q[..., part], k[..., part]) + bias[h]
        outputs.append(torch.einsum("bts,sbd->tbd", logits.softmax(-1), v[..., part]))
    return module.out_proj(torch.cat(outputs, dim=-1))


@pytest.mark.parametrize("need_weights", [True, False])
def test_logit_bias_hook_and_incremental_positions(need_weights):
    _, ours = pair("self")
    encoding = ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1))
    ours.bind_position(encoding, "decoder", 0)
    x = torch.randn(5, 2, EMBED)
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    bias = torch.stack([(h + 1) * (j - i).float() / 10 for h in range(HEADS)])
    expected = naive_attention(ours, x, bias)
    got, _ = ours(x, x, x, need_weights=need_weights)
    assert (expected - got).abs().max() <= 1e-5
    # step by step, the query of step t sits at position t: equal to the full (non-causal
    # would differ, so compare against the causal naive result)
    causal = bias.masked_fill(j > i, float("-inf"))
    expected_causal = naive_attention(ours, x, causal)
    state = {}
    steps = [ours(x[t: t + 1], x[t: t + 1], x[t: t + 1], incremental_state=state, need_weights=need_weights)[0]
             for t in range(5)]
    assert (torch.cat(steps) - expected_causal).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_masks_do_not_produce_nan(dtype):
    _, ours = pair("self")
    ours.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    ours = ours.to(dtype)
    x = torch.randn(6, 2, EMBED, dtype=dtype)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, :] = True  # a fully padded row: -inf masks would give NaN here
    for need_weights in (True, False):
        out, _ = ours(x, x, x, key_padding_mask=mask, need_weights=need_weights)
        assert torch.isfinite(out).all()
    _, reference32 = pair("self")
    reference32.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    mask[1, :] = False
    mask[1, :3] = True
    out, _ = ours(x, x, x, key_padding_mask=mask, need_weights=False)
    out32, _ = reference32(x.float(), x.float(), x.float(), key_padding_mask=mask, need_weights=False)
    assert (out.float() - out32).abs().max() < 5e-2
