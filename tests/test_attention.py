"""PositionalAttention against fairseq's MultiheadAttention and against a naive formula."""
import pytest
import torch

import posenc_fairseq  # noqa: F401
from fairseq.modules import MultiheadAttention
from fairseq import utils
from posenc_fairseq.attention import use_positional_attention
from posenc_fairseq.encodings.base import ModelDims, PositionalEncoding
from posenc_fairseq.encodings.distance import DistanceTerm
from posenc_fairseq.encodings.positions import tensor_of

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

    def distance_term(self, role, layer, low, high, queries, dtype):
        heads = torch.arange(1, HEADS + 1, dtype=torch.float)[:, None]
        return DistanceTerm(low, high, bias=heads * torch.arange(low, high + 1).float()[None, :] / 10)


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
def test_distance_term_hook_and_incremental_positions(need_weights):
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


class ContentOnly(PositionalEncoding):
    """A test encoding whose term is a content vector alone: u_h . k_j (no bias, no vectors)."""

    def __init__(self, dims):
        super().__init__(None, dims)
        self.content = torch.nn.Parameter(torch.randn(HEADS, 1, EMBED // HEADS, generator=torch.Generator().manual_seed(2)))

    def distance_term(self, role, layer, low, high, queries, dtype):
        return DistanceTerm(low, high, content=self.content.to(dtype))


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_a_term_of_a_content_vector_alone(need_weights, grad):
    """Every kernel folds it into the queries, (q + u).k_j, leaving no dense term to add."""
    _, ours = pair("self")
    encoding = ContentOnly(ModelDims(EMBED, HEADS, 1, 1))
    ours.bind_position(encoding, "encoder", 0)
    x = torch.randn(5, 2, EMBED)
    q, k, v = ours.q_proj(x) * ours.scaling, ours.k_proj(x), ours.v_proj(x)
    outputs = []
    for h in range(HEADS):
        part = slice(h * ours.head_dim, (h + 1) * ours.head_dim)
        logits = torch.einsum("tbd,sbd->bts", q[..., part] + encoding.content[h, 0], k[..., part])
        outputs.append(torch.einsum("bts,sbd->tbd", logits.softmax(-1), v[..., part]))
    expected = ours.out_proj(torch.cat(outputs, dim=-1))
    with torch.set_grad_enabled(grad):
        encoding.begin("encoder")
        got, _ = ours(x, x, x, need_weights=need_weights)
    assert (expected - got).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_masks_do_not_produce_nan(dtype):
    _, ours = pair("self")
    ours.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    ours = ours.to(dtype)
    x = torch.randn(6, 2, EMBED, dtype=dtype)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, :] = True  # a fully padded row: -inf masks would give NaN here
    for need_weights in (True, False):
        # large logits too: a blocked logit's fill must not overflow to -inf when added to one
        for scale in (1.0, 40.0):
            out, weights = ours(x * scale, x * scale, x * scale, key_padding_mask=mask, need_weights=need_weights)
            assert torch.isfinite(out).all()
            if need_weights:
                assert torch.allclose(weights[1].float(), torch.full((6, 6), 1 / 6), atol=1e-3)  # no key: uniform
    _, reference32 = pair("self")
    reference32.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    mask[1, :] = False
    mask[1, :3] = True
    out, _ = ours(x, x, x, key_padding_mask=mask, need_weights=False)
    out32, _ = reference32(x.float(), x.float(), x.float(), key_padding_mask=mask, need_weights=False)
    assert (out.float() - out32).abs().max() < 5e-2


@pytest.mark.parametrize("bias", [False, True], ids=["no term", "a bias term"])
@pytest.mark.parametrize("causal", [False, True], ids=["a sentence all padding", "left padding, causal"])
def test_rows_that_see_no_key_have_the_explicit_gradients(bias, causal):
    """A query whose keys are all blocked gets uniform weights over all keys, forward and backward, on
    the fused path (SDPA: weights not asked for) as on the explicit one (weights asked for). SDPA's
    fused kernels keep a row's log-sum-exp, which the finite fill absorbs (log Tk is lost), so with the
    fill such a row's backward weighted each key 1 instead of 1 / Tk."""
    _, ours = pair("self")
    if bias:
        ours.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "decoder" if causal else "encoder", 0)
    ours.train()
    x = torch.randn(6, 2, EMBED)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    if causal:
        mask[1, :3] = True  # queries 0..2 of sentence 1 see only padding
    else:
        mask[1, :] = True
    attn_mask = utils.fill_with_neg_inf(torch.zeros(6, 6)).triu(1) if causal else None
    results = []
    for need_weights in (False, True):
        ours.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out, _ = ours(leaf, leaf, leaf, key_padding_mask=mask, attn_mask=attn_mask, need_weights=need_weights)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), leaf.grad] + [p.grad.clone() for p in ours.parameters()])
    for got, expected in zip(*results):
        assert (got - expected).abs().max() <= 1e-5 * (1 + expected.abs().max())


# --- fairseq features inside the attention (issue 10; model-level tests in models/test_workflows.py) ---
@pytest.mark.parametrize("need_weights", [True, False])
def test_retained_dropout_applies_on_both_paths(need_weights):
    """--retain-dropout sets FairseqDropout.apply_during_inference; the attention follows the dropout
    module's own decision on the SDPA path (need_weights=False) as on the explicit one."""
    _, ours = pair("self")
    ours.dropout_module.p = 0.5
    x = torch.randn(6, 2, EMBED)
    first, second = (ours(x, x, x, need_weights=need_weights)[0] for _ in range(2))
    assert torch.equal(first, second)  # eval: no dropout
    ours.dropout_module.apply_during_inference = True
    first, second = (ours(x, x, x, need_weights=need_weights)[0] for _ in range(2))
    assert (first - second).abs().max() > 1e-3


class RecordingShift(ConstantBias):
    """ConstantBias plus a q/k projection shift by position, recording the positions it is given."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = {}

    def project(self, role, layer, which, x, positions):
        positions = tensor_of(positions)
        self.seen.setdefault(which, []).append(positions.clone())
        if which == "v":
            return x
        return x + 0.1 * positions.t()[..., None].to(x.dtype)


def cross_self_module(encoding, source_positions, target_positions):
    """The decoder self-attention fairseq builds for --cross-self-attention (self_attention=False)."""
    torch.manual_seed(0)
    module = MultiheadAttention(EMBED, HEADS, self_attention=False)
    use_positional_attention(module)
    module.bind_position(encoding, "decoder", 0)
    encoding.begin("decoder", target_positions, source_positions)
    return module.eval()


@pytest.mark.parametrize("need_weights", [True, False])
def test_cross_self_attention_positions_and_bias(need_weights):
    """Keys cat(source, target): the projection hook sees cat(source positions, target positions);
    the relative bias covers the target keys only (nothing on the source keys, as on cross-attention);
    step-by-step (source cached with the first step) equals the full call."""
    source_len, target_len, batch = 4, 5, 2
    encoding = RecordingShift(None, ModelDims(EMBED, HEADS, 1, 1))
    source_positions = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]])  # row 0 left-padded by one token
    target_positions = torch.arange(target_len).expand(batch, target_len)
    module = cross_self_module(encoding, source_positions, target_positions)
    memory, x = torch.randn(source_len, batch, EMBED), torch.randn(target_len, batch, EMBED)
    keys = torch.cat([memory, x])
    causal = torch.triu(torch.full((target_len, target_len), float("-inf")), 1)
    attn_mask = torch.cat([torch.zeros(target_len, source_len), causal], dim=1)
    got, _ = module(x, keys, keys, attn_mask=attn_mask, need_weights=need_weights)
    assert torch.equal(encoding.seen["k"][0], torch.cat([source_positions, target_positions], dim=1))
    assert torch.equal(encoding.seen["q"][0], target_positions)
    # naive: shifted q/k by position, bias (h+1)(j-i)/10 between target tokens, 0 towards source keys
    q = (module.q_proj(x) + 0.1 * target_positions.t()[..., None]) * module.scaling
    k = module.k_proj(keys) + 0.1 * torch.cat([source_positions, target_positions], 1).t()[..., None]
    v = module.v_proj(keys)
    i, j = torch.arange(target_len)[:, None], torch.arange(target_len)[None, :]
    outputs = []
    for h in range(HEADS):
        part = slice(h * module.head_dim, (h + 1) * module.head_dim)
        bias = torch.cat([torch.zeros(target_len, source_len), (h + 1) * (j - i).float() / 10 + causal], dim=1)
        logits = torch.einsum("tbd,sbd->bts", q[..., part], k[..., part]) + bias
        outputs.append(torch.einsum("bts,sbd->tbd", logits.softmax(-1), v[..., part]))
    expected = module.out_proj(torch.cat(outputs, dim=-1))
    assert (got - expected).abs().max() <= 1e-5
    # fairseq's step-by-step call: cat(source, step 0) first, then each step alone
    state, steps = {}, []
    for t in range(target_len):
        encoding.begin("decoder", target_positions[:, t: t + 1], earlier=t)  # (the first step's source kept)
        step_keys = torch.cat([memory, x[:1]]) if t == 0 else x[t: t + 1]
        steps.append(module(x[t: t + 1], step_keys, step_keys, incremental_state=state, need_weights=need_weights)[0])
    assert (torch.cat(steps) - expected).abs().max() <= 1e-5


def test_repeated_head_pruning_keeps_original_head_terms():
    """Two rounds of _adaptive_prune_heads equal one round to the same heads: per-head logit bias
    columns follow the original head index."""
    x = torch.randn(5, 2, EMBED)
    results = []
    for rounds in ([[3, 0, 1], [1, 2]], [[0, 1]]):  # 4 -> (3, 0, 1) -> (0, 1)  vs  4 -> (0, 1)
        _, ours = pair("self")
        ours.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
        for heads in rounds:
            d = ours.head_dim
            ours._adaptive_prune_heads([(h * d, (h + 1) * d) for h in heads])
        assert ours.kept_heads.tolist() == [0, 1]
        results.append(ours(x, x, x, need_weights=False)[0])
    assert (results[0] - results[1]).abs().max() <= 1e-6
    _, full = pair("self")
    full.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    with torch.no_grad():
        full.out_proj.weight[:, 2 * full.head_dim:] = 0  # heads 2, 3 silenced
    assert (full(x, x, x, need_weights=False)[0] - results[1]).abs().max() <= 1e-5


def test_torchscript_is_refused_with_one_message():
    _, ours = pair("self")
    with pytest.raises(RuntimeError, match="cannot be compiled with TorchScript"):
        torch.jit.script(ours)


def test_blocks_future_recognises_fairseq_future_mask_only():
    """The future-mask check: fairseq's mask (a slice of its buffered -inf mask, or a bool mask)
    blocks every key after its query; anything else (a future key let through, other shapes, a
    cached step's queries) does not count; a mask is read each time (an in-place change is seen)."""
    from posenc_fairseq.attention import blocks_future
    buffered = torch.triu(utils.fill_with_neg_inf(torch.zeros(10, 10)), 1)
    assert blocks_future(buffered[:6, :6], 6, 6)
    assert blocks_future(torch.ones(5, 5, dtype=torch.bool).triu(1), 5, 5)
    assert blocks_future(buffered[:6, :6].clone(), 6, 6)
    assert blocks_future(torch.triu(utils.fill_with_neg_inf(torch.zeros(4, 7)), 4), 4, 7)  # the last 4 queries
    assert not blocks_future(torch.triu(utils.fill_with_neg_inf(torch.zeros(4, 7)), 5), 4, 7)  # key 4 open to query 3
    assert not blocks_future(None, 6, 6)
    assert not blocks_future(buffered[:6, :6], 6, 7)
    assert not blocks_future(torch.zeros(6, 6), 6, 6)
    view = buffered[:6, :6]
    assert blocks_future(view, 6, 6)
    buffered[2, 4] = 0.0  # a future key let through, in place: the check is made again
    assert not blocks_future(buffered[:6, :6], 6, 6)
    assert not blocks_future(view, 6, 6)
    assert blocks_future(buffered[:2, :2], 2, 2)


def test_the_decoder_stack_names_its_future_mask_in_the_pass_context(translation_data, monkeypatch):
    """The decoder stack's pass context holds the very mask fairseq made for its self-attention
    (`buffered_future_mask`, once per layer), and the attention calls given it know it blocks the
    future without reading it; any other mask is read."""
    from posenc_fairseq.kernels import masks

    from util import TINY_TRANSFORMER, build_model, random_batch
    model, task, _ = build_model(translation_data, "transformer_t5", TINY_TRANSFORMER)
    model.eval()
    src, lengths, prev = random_batch(task.source_dictionary, tgt_len=6)
    made, seen, checks = [], [], []
    buffered = type(model.decoder).buffered_future_mask
    monkeypatch.setattr(type(model.decoder), "buffered_future_mask",
                        lambda self, tensor: made.append(buffered(self, tensor)) or made[-1])
    blocks_future = posenc_fairseq.attention.blocks_future
    monkeypatch.setattr(posenc_fairseq.attention, "blocks_future",
                        lambda mask, queries, keys, made_by_stack: checks.append(made_by_stack)
                        or blocks_future(mask, queries, keys, made_by_stack))
    serve = posenc_fairseq.attention.serve
    monkeypatch.setattr(posenc_fairseq.attention, "serve",
                        lambda call, plan, dropout: seen.append(call) or serve(call, plan, dropout))
    with torch.no_grad():
        model(src, lengths, prev)
    context = model.positional_encoding.contexts["decoder"]
    assert len(made) == 2 and context.future_mask is made[-1]  # fairseq makes it again for each layer
    decoder_calls = [call for call in seen if call.attn_mask is not None]
    assert len(decoder_calls) == 2 and all(call.stack_mask for call in decoder_calls)
    assert [call.future_blocked for call in decoder_calls] == [True, False]  # T5's bias: in the first layer
    assert checks == [True]  # answered without reading the mask
    # a mask the stack did not make is read: the same values in another tensor, or one future key let through
    assert masks.blocks_future(made[0].clone(), 6, 6) and masks.only_blocks(made[0].clone())
    opened = made[0].clone()
    opened[1, 3] = 0.0
    assert not masks.blocks_future(opened, 6, 6)
    assert not masks.only_blocks(opened + 1)


@pytest.mark.parametrize("name,need_weights", [("alibi", False), ("xl", False), ("xl", True), ("sinusoidal", False)])
@pytest.mark.parametrize("already_flushing", [False, True])
def test_subnormals_flushed_during_attention_backward_only(monkeypatch, name, need_weights, already_flushing):
    """Biased attention's backward on CPU runs with subnormals flushed (SDPA and explicit paths):
    switched on at the attention's output and off again when its backward is done, never left on,
    never switched off when the thread already flushed them; gradients as without flushing (what is
    flushed is below 1.2e-38). An encoding that adds nothing to the logits leaves the thread alone
    (its additive term is the padding alone)."""
    from posenc_fairseq.kernels import subnormals
    from util import bound_attention, perturbed_encoding

    enc = perturbed_encoding(name, dims=ModelDims(32, 4, 1, 1))
    module = bound_attention(enc, "encoder", 0, 32, 4, torch.float32)
    x = torch.randn(40, 2, 32) * 30  # wide logits: many probabilities underflow
    switched = []
    set_flush = torch.set_flush_denormal

    def recording(on):
        switched.append(on)
        return set_flush(on)

    def gradients(flush):
        enc.begin("encoder")
        monkeypatch.setattr(torch, "set_flush_denormal", recording if flush else lambda on: True)
        inputs = x.clone().requires_grad_()
        padding = torch.zeros(2, 40, dtype=torch.bool)
        padding[1, -5:] = True
        out, _ = module(inputs, inputs, inputs, key_padding_mask=padding, need_weights=need_weights)
        seen = []
        inputs.register_hook(lambda grad: seen.append(subnormals._flushing_subnormals()))
        out.pow(2).sum().backward()
        monkeypatch.setattr(torch, "set_flush_denormal", set_flush)
        return inputs.grad, seen

    set_flush(already_flushing)
    try:
        expected, _ = gradients(flush=False)
        got, seen = gradients(flush=True)
        assert seen == [already_flushing]  # off again by the time the input's gradient arrives
        assert subnormals._flushing_subnormals() == already_flushing
        assert switched == ([] if already_flushing or name == "sinusoidal" else [True, False])
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max())
    finally:
        set_flush(False)


def test_a_float_mask_with_finite_terms_adds_them_also_after_in_place_changes():
    """A float attn_mask of 0/-inf only adds no finite part (remembered per mask tensor and in-place
    version: fairseq's future mask); finite entries are added, also when they appear in place in a
    mask already seen as 0/-inf only. Each against fairseq's attention."""
    reference, ours = pair("self")
    x = torch.randn(6, 3, EMBED)
    attn_mask = utils.fill_with_neg_inf(torch.zeros(6, 6)).triu(1)
    for change in (None, lambda m: m[2, :2].fill_(-1.5), lambda m: m[4, 1].fill_(0.75)):
        if change is not None:
            change(attn_mask)
        for need_weights in (True, False):
            expected, _ = reference(x, x, x, attn_mask=attn_mask, need_weights=need_weights)
            got, _ = ours(x, x, x, attn_mask=attn_mask, need_weights=need_weights)
            assert (expected - got).abs().max() <= 1e-5


@pytest.mark.parametrize("autocast", [False, True])
def test_half_precision_logits_past_the_dtypes_range_stay_finite_on_the_explicit_path(autocast):
    """q.k beyond fp16's 65504 (FLOATER's biases far past the training lengths make such logits): the
    explicit softmax (attention weights asked for) computes the logits in float32, as the fused kernels
    do, also under autocast (which would cast the product back), and gives what the fused path gives;
    before, inf logits, then NaN outputs."""
    import contextlib

    dtype = torch.float16
    _, ours = pair("self")
    ours.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    ours = ours.to(dtype)
    scope = torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext()
    with torch.no_grad():
        for projection in (ours.q_proj, ours.k_proj):
            projection.weight.mul_(300.0)  # |q|, |k| in the hundreds, q.k/sqrt(d) about 1e5
    x = torch.randn(6, 2, EMBED, generator=torch.Generator().manual_seed(1)).to(dtype)
    with scope:
        fused, _ = ours(x, x, x, need_weights=False)
        explicit, weights = ours(x, x, x, need_weights=True)
    scores = ours.q_proj(x)[:, 0, :4].float() @ ours.k_proj(x)[:, 0, :4].float().T * 0.5  # head 0, row 0
    assert scores.abs().max() > 65504  # (the case: past the dtype's range)
    assert torch.isfinite(explicit).all() and torch.isfinite(weights).all()
    assert (explicit.float() - fused.float()).abs().max() <= 2e-2 * fused.float().abs().max()


# --- training dropout, steps over cached padding, weights and logits as fairseq gives them, cross-self terms ---
def future_mask(length):
    """fairseq's future mask (the decoder stack's `buffered_future_mask`): -inf above the diagonal."""
    return utils.fill_with_neg_inf(torch.zeros(length, length)).triu(1)


def test_training_dropout_applies_on_the_causal_sdpa_path():
    """Decoder self-attention under fairseq's future mask with no padding and no terms is SDPA told
    `is_causal`; in training it drops attention weights too: two calls differ, eval calls are equal
    (and equal to fairseq's), and the mean over 400 dropped copies of a sentence approaches the eval
    output (dropout is rescaled by 1 / (1 - p), so the mean of the outputs is the undropped one)."""
    reference, ours = pair("self")
    ours.dropout_module.p = 0.3
    x = torch.randn(6, 1, EMBED)
    mask = future_mask(6)
    expected, _ = reference(x, x, x, attn_mask=mask, need_weights=False)
    evaluated = [ours(x, x, x, attn_mask=mask, need_weights=False)[0] for _ in range(2)]
    assert torch.equal(evaluated[0], evaluated[1])
    assert (evaluated[0] - expected).abs().max() <= 1e-5
    ours.train()
    copies = x.expand(6, 400, EMBED)  # each copy draws its own dropout
    with torch.no_grad():
        first, second = (ours(copies, copies, copies, attn_mask=mask, need_weights=False)[0] for _ in range(2))
    assert (first - second).abs().max() > 1e-2
    assert (first[:, :1] - first[:, 1:2]).abs().max() > 1e-2
    assert (first.mean(1, keepdim=True) - expected).abs().max() <= 0.1 * (first - expected).abs().max()


def test_a_decoding_step_applies_the_cached_keys_padding():
    """A left-padded prompt decoded with an incremental state: the prefix call, then one-query steps
    (the STEP kernel). Each step's keys include the cached padded ones, which the cached key padding
    mask blocks: the steps' outputs equal the naive formula with the bias, the padding and the future
    mask, and the full call's last rows."""
    _, ours = pair("self")
    ours.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "decoder", 0)
    length, batch, prefix = 5, 2, 3
    x = torch.randn(length, batch, EMBED)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, :2] = True  # row 0: a prompt left-padded by two tokens
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    bias = torch.stack([(h + 1) * (j - i).float() / 10 for h in range(HEADS)])[:, None]  # (H, 1, T, T)
    bias = bias.masked_fill(j > i, float("-inf")).masked_fill(padding[None, :, None, :], float("-inf"))
    expected = naive_attention(ours, x, bias)[prefix:]  # (rows 0, 1 of sentence 0 see no key: not compared)
    full, _ = ours(x, x, x, key_padding_mask=padding, attn_mask=future_mask(length), need_weights=False)
    state = {}
    ours(x[:prefix], x[:prefix], x[:prefix], key_padding_mask=padding[:, :prefix], attn_mask=future_mask(prefix),
         incremental_state=state, need_weights=False)
    steps = [ours(x[t: t + 1], x[t: t + 1], x[t: t + 1], key_padding_mask=padding[:, t: t + 1],
                  incremental_state=state, need_weights=False)[0] for t in range(prefix, length)]
    assert (torch.cat(steps) - expected).abs().max() <= 1e-5
    assert (full[prefix:] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("need_head_weights", [False, True])
def test_weights_in_training_are_those_before_dropout(need_head_weights):
    """need_weights in training returns the softmax before attention dropout, as fairseq's own
    attention does (taken here with an incremental state: its fast path is PyTorch's, which returns
    the dropped weights); with the same seed the same dropout is drawn, so the outputs agree too."""
    reference, ours = pair("self")
    for module in (reference, ours):
        module.dropout_module.p = 0.4
        module.train()
    x = torch.randn(6, 3, EMBED)
    padding_mask = padding(3, 6)
    results = []
    for module in (reference, ours):
        torch.manual_seed(5)
        results.append(module(x, x, x, key_padding_mask=padding_mask, attn_mask=future_mask(6), incremental_state={},
                              need_head_weights=need_head_weights))
    (expected, expected_weights), (got, weights) = results
    assert (got - expected).abs().max() <= 1e-5
    assert weights.shape == expected_weights.shape
    assert (weights - expected_weights).abs().max() <= 1e-6
    assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-6)  # not dropped: each row sums to 1


def test_the_relative_value_term_mixes_the_dropped_weights():
    """Shaw's value term in training: out = (P * m) v + sum over distances of (P * m) a^V, the dropout
    mask m (0 or 1 / (1 - p)) applied to the weights that mix both the values and the value term. The
    mask is drawn again from the same seed, as the dropout module draws it on the (B, H, T, T) weights;
    the terms come from `position_terms` (the gather over the pairs' distances)."""
    from position_terms import logits_between, values_between
    from util import bound_attention, perturbed_encoding

    enc = perturbed_encoding("shaw", "--shaw-k", "2", dims=ModelDims(EMBED, HEADS, 1, 1))
    module = bound_attention(enc, "encoder", 0, EMBED, HEADS)
    module.dropout_module.p = 0.3
    module.train()
    length, batch = 6, 2
    x = torch.randn(length, batch, EMBED, dtype=torch.float64)
    positions = torch.arange(length)
    with torch.no_grad():
        enc.begin("encoder")
        torch.manual_seed(9)
        got, _ = module(x, x, x, need_weights=False)
        torch.manual_seed(9)
        dropped = torch.nn.functional.dropout(torch.ones(batch, HEADS, length, length, dtype=torch.float64), 0.3)
        assert (dropped == 0).any()  # (the case: some weights dropped)

        def heads(y):
            return y.view(length, batch, HEADS, -1).permute(1, 2, 0, 3)
        q, k, v = heads(module.q_proj(x) * module.scaling), heads(module.k_proj(x)), heads(module.v_proj(x))
        enc.begin("encoder")
        logits = q @ k.transpose(-1, -2) + logits_between(enc, "encoder", 0, q, k, positions, positions)
        weights = logits.softmax(-1) * dropped
        out = weights @ v + values_between(enc, "encoder", 0, weights, positions, positions)
        expected = module.out_proj(out.permute(2, 0, 1, 3).reshape(length, batch, EMBED))
    assert (got - expected).abs().max() <= 1e-10


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", ["content alone", "xl"])
def test_cross_self_attention_content_term_covers_the_target_keys_only(name, need_weights):
    """XL's content term u_h . k_j under --cross-self-attention: on the target keys only, nothing on
    the source keys (no term reaches them, as on cross-attention), whether or not the kernel could
    fold u into the queries. A naive reference: the term `position_terms` gives between the target
    positions, and zeros on the source keys."""
    from position_terms import logits_between
    from util import perturbed_encoding

    source_len, target_len, batch = 4, 5, 2
    if name == "xl":
        encoding = perturbed_encoding("xl", dims=ModelDims(EMBED, HEADS, 1, 1)).float()
    else:
        encoding = ContentOnly(ModelDims(EMBED, HEADS, 1, 1))
    source_positions = torch.arange(source_len).expand(batch, source_len)
    target_positions = torch.arange(target_len).expand(batch, target_len)
    module = cross_self_module(encoding, source_positions, target_positions)
    memory, x = torch.randn(source_len, batch, EMBED), torch.randn(target_len, batch, EMBED)
    keys = torch.cat([memory, x])
    causal = future_mask(target_len)
    attn_mask = torch.cat([torch.zeros(target_len, source_len), causal], dim=1)
    with torch.no_grad():
        got, _ = module(x, keys, keys, attn_mask=attn_mask, need_weights=need_weights)

        def heads(y):
            return y.view(y.size(0), batch, HEADS, -1).permute(1, 2, 0, 3)
        q, k, v = heads(module.q_proj(x) * module.scaling), heads(module.k_proj(keys)), heads(module.v_proj(keys))
        positions = torch.arange(target_len)
        if name == "xl":
            term = logits_between(encoding, "decoder", 0, q, k[:, :, source_len:], positions, positions)
        else:  # u_h . k_j, written out
            term = torch.einsum("hd,bhsd->bhs", encoding.content[:, 0], k[:, :, source_len:])[:, :, None, :]
        term = torch.cat([torch.zeros(batch, HEADS, target_len, source_len),
                          term.expand(batch, -1, target_len, -1)], dim=-1)
        logits = q @ k.transpose(-1, -2) + term + attn_mask
        out = logits.softmax(-1) @ v
        expected = module.out_proj(out.permute(2, 0, 1, 3).reshape(target_len, batch, EMBED))
    assert (got - expected).abs().max() <= 1e-5


def test_logits_before_softmax_are_masked_as_fairseqs():
    """before_softmax returns the scaled logits with the masks applied, as fairseq's attention does
    (its own path, taken with an incremental state: its fast path ignores before_softmax): equal
    where fairseq's are finite, the blocked fill (at most -1e30) where fairseq's are -inf."""
    reference, ours = pair("self")
    x = torch.randn(6, 3, EMBED)
    padding_mask = padding(3, 6)
    expected, expected_values = reference(x, x, x, key_padding_mask=padding_mask, attn_mask=future_mask(6),
                                          incremental_state={}, before_softmax=True)
    got, values = ours(x, x, x, key_padding_mask=padding_mask, attn_mask=future_mask(6), before_softmax=True)
    assert got.shape == expected.shape == (3 * HEADS, 6, 6)
    blocked = torch.isneginf(expected)
    assert blocked.any() and not blocked.all()
    assert (got[~blocked] - expected[~blocked]).abs().max() <= 1e-5
    assert (got[blocked] <= -1e30).all()
    assert (values - expected_values).abs().max() <= 1e-6
