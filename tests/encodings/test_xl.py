"""XL-RPE and GCDF-RPE against naive (i, j) loops written straight from eqs. 6-8 and 14-15."""
import math

import pytest
import torch

import posenc_fairseq  # noqa: F401
import posenc_fairseq.attention
from posenc_fairseq.kernels import blocks as block_module, step as step_module, terms as terms_module
from posenc_fairseq.encodings import ENCODINGS, ModelDims, build_encoding, distance
from posenc_fairseq.encodings.distance import dense_logits, distance_range
from posenc_fairseq.encodings.xl import gcdf_prior, sinusoidal_prior
from position_terms import logits_between, position_range
from util import attention_steps, count_calls, assert_attention_runs_on, bound_attention, encoding_options, perturbed_encoding, QUICK_TRAIN, TINY_TRANSFORMER, USER_DIR, run

EMBED, HEADS, LAYERS = 16, 4, 3


def encoding(name, *argv, seed=1):
    return perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, LAYERS, LAYERS), seed=seed)


def attention(enc, role, layer, embed=EMBED, heads=HEADS, dtype=torch.float64):
    return bound_attention(enc, role, layer, embed, heads, dtype)


def inputs(length=7, batch=2, left=True):
    torch.manual_seed(2)
    x = torch.randn(length, batch, EMBED, dtype=torch.float64)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    if left:  # left padding in row 1 (fairseq's source side)
        padding[1, :2] = True
    else:  # right padding (target side: a causal query row is never fully masked)
        padding[1, -2:] = True
    return x, padding


def causal_mask(length):
    return torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1)


# --- the priors, one number at a time ----------------------------------------------------------
def xl_r(d, d_model):
    """Eqs. 6-7: R^(2k) = sin(d / 10000^(2k/d_model)), R^(2k+1) = cos(d / 10000^(2k/d_model))."""
    out = []
    for m in range(d_model):
        two_k = m - (m % 2)
        angle = d / 10000 ** (two_k / d_model)
        out.append(math.sin(angle) if m % 2 == 0 else math.cos(angle))
    return torch.tensor(out, dtype=torch.float64)


def gcdf_r(d, d_model, lam=4.0):
    """Eqs. 14-15 through the Gaussian CDF: lambda * Phi(d / sigma_k), sigma_k = d_model^(k/d_model)."""
    out = []
    for m in range(d_model):
        sigma = d_model ** (m / d_model)
        out.append(lam * 0.5 * (1 + math.erf(d / (sigma * math.sqrt(2)))))
    return torch.tensor(out, dtype=torch.float64)


def naive(module, enc, role, layer, x, padding, causal, prior, blocked=None):
    """P_ij = (q_i.k_j + q_i.W_r R_{i-j} + u.k_j + v.W_r R_{i-j}) / sqrt(d), softmax, sum alpha v.
    `blocked` (T, T) bool: the mask's blocked pairs, in place of the causal ones."""
    length, batch, embed = x.shape
    heads = module.num_heads
    d = embed // heads
    q, k, v = module.q_proj(x), module.k_proj(x), module.v_proj(x)
    w_r = enc.projections[f"{role}{layer}"].weight
    u, v_bias = enc.content_bias[role], enc.position_bias[role]
    z = torch.zeros(length, batch, embed, dtype=x.dtype)
    for b in range(batch):
        for h in range(heads):
            part = slice(h * d, (h + 1) * d)
            for i in range(length):
                scores = []
                for j in range(length):
                    r = (w_r @ prior(i - j))[part]
                    p = (q[i, b, part] @ k[j, b, part] + q[i, b, part] @ r + u[h] @ k[j, b, part] + v_bias[h] @ r) / math.sqrt(d)
                    if padding[b, j] or (bool(blocked[i, j]) if blocked is not None else causal and j > i):
                        p = torch.tensor(float("-inf"), dtype=x.dtype)
                    scores.append(p)
                alpha = torch.softmax(torch.stack(scores), dim=0)
                for j in range(length):
                    z[i, b, part] += alpha[j] * v[j, b, part]
    return module.out_proj(z)


@pytest.mark.parametrize("name", ["xl", "gcdf"])
@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("block", [None, 3], ids=["whole", "query-blocks"])
def test_attention_output_equals_naive_loops(name, role, layer, block, monkeypatch):
    """block 3: the attention computes the relative terms 3 queries at a time (long-input path)."""
    if block is not None:
        monkeypatch.setattr(block_module, "QUERY_BLOCK", block)
        monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    argv = ["--gcdf-lambda", "3"] if name == "gcdf" else []
    enc = encoding(name, *argv)
    prior = (lambda d: xl_r(d, EMBED)) if name == "xl" else (lambda d: gcdf_r(d, EMBED, lam=3.0))
    module = attention(enc, role, layer)
    causal = role == "decoder"
    x, padding = inputs(left=not causal)
    mask = causal_mask(len(x)) if causal else None
    enc.begin(role)
    got, _ = module(x, x, x, key_padding_mask=padding, attn_mask=mask)
    with torch.no_grad():
        expected = naive(module, enc, role, layer, x, padding, causal, prior)
    assert (got - expected).abs().max() <= 1e-5
    baseline, _ = attention(None, role, layer)(x, x, x, key_padding_mask=padding, attn_mask=mask)
    assert (got - baseline).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["xl", "gcdf"])
@pytest.mark.parametrize("block", [None, 3], ids=["whole", "query-blocks"])
@pytest.mark.parametrize("future", ["blocked", "one key open"])
def test_decoder_mask_other_than_the_future_mask(name, block, future, monkeypatch):
    """Under fairseq's future mask the attention skips the distances d < -1 (and a block the keys
    after its last query); a decoder mask that lets one future key through must see its term."""
    if block is not None:
        monkeypatch.setattr(block_module, "QUERY_BLOCK", block)
        monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    enc = encoding(name)
    prior = (lambda d: xl_r(d, EMBED)) if name == "xl" else (lambda d: gcdf_r(d, EMBED))
    module = attention(enc, "decoder", 1)
    x, padding = inputs(length=8, left=False)
    mask = causal_mask(len(x))
    if future == "one key open":
        mask[1, 6] = 0.0
    enc.begin("decoder")
    got, _ = module(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=False)
    with torch.no_grad():
        expected = naive(module, enc, "decoder", 1, x, padding, True, prior, blocked=torch.isneginf(mask))
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["xl", "gcdf"])
def test_future_blocked_logits_agree_where_not_blocked(name):
    """`future_blocked` (`dense_logits`) reads distances low..+1 only: the same logits for every key
    up to its query, for the whole call and a block of queries (the last of its keys)."""
    enc = encoding(name)
    torch.manual_seed(4)
    q, k = torch.randn(2, HEADS, 9, 4, dtype=torch.float64), torch.randn(2, HEADS, 9, 4, dtype=torch.float64)
    for first, stop in ((0, 9), (3, 7)):
        enc.begin("decoder")
        low, high = distance_range(position_range(first, stop), position_range(0, stop))
        term = enc.distance_term("decoder", 1, low, high, stop - first, q.dtype)
        full = dense_logits(term, q[:, :, first:stop], k[:, :, :stop])
        cut = dense_logits(term, q[:, :, first:stop], k[:, :, :stop], future_blocked=True)
        seen = torch.arange(first, stop)[:, None] >= torch.arange(stop)[None, :]
        assert torch.isfinite(cut).all()
        assert (full - cut).abs()[..., seen].max() <= 1e-12
        assert (full - cut).abs()[..., ~seen].max() > 1e-3  # the blocked entries were not computed


@pytest.mark.parametrize("name", ["xl", "gcdf"])
@pytest.mark.parametrize("layer", [0, 2])
def test_decoding_steps_in_inference_fold_the_terms_and_equal_naive_loops(name, layer, monkeypatch):
    """Incremental decoding in inference: each step is plain attention of (q + u) against
    (k_j + W_r R_{i-j}) with (v - u).W_r R_{i-j} added (`step_terms`, kept across steps), without
    the dense logit form; every step equals the naive loops' row."""
    enc = encoding(name)
    enc.eval()
    module = attention(enc, "decoder", layer)
    module.eval()
    x, _ = inputs()
    no_padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    prior = (lambda d: xl_r(d, EMBED)) if name == "xl" else (lambda d: gcdf_r(d, EMBED))
    with torch.no_grad():
        expected = naive(module, enc, "decoder", layer, x, no_padding, True, prior)
    calls = count_calls(monkeypatch, [(step_module, "step_terms"), (terms_module, "dense_logits"),
                                      (distance, "dense_logits")])
    steps = attention_steps(module, enc, x)
    assert calls == ["step_terms"] * len(x)
    assert (steps - expected).abs().max() <= 1e-10


@pytest.mark.parametrize("name", ["xl", "gcdf"])
def test_stepwise_decoder_queries_match_full(name):
    """The last query of a call with cached keys (incremental decoding) sees the same logits."""
    enc = encoding(name)
    torch.manual_seed(3)
    q, k = torch.randn(2, HEADS, 6, 4, dtype=torch.float64), torch.randn(2, HEADS, 6, 4, dtype=torch.float64)
    positions = torch.arange(6)
    enc.begin("decoder")
    full = logits_between(enc, "decoder", 1, q, k, positions, positions)
    for t in range(6):
        enc.begin("decoder")
        step = logits_between(enc, "decoder", 1, q[:, :, t: t + 1], k[:, :, : t + 1], positions[t: t + 1], positions[: t + 1])
        assert (step - full[:, :, t: t + 1, : t + 1]).abs().max() <= 1e-12


def test_xl_prior_is_eqs_6_7():
    distances = torch.arange(-9, 10)
    for d_model in (16, 17):
        got = sinusoidal_prior(distances, d_model)
        expected = torch.stack([xl_r(d, d_model) for d in distances.tolist()])
        assert (got - expected).abs().max() <= 1e-12


def test_gcdf_prior_is_eqs_14_15():
    distances = torch.arange(-9, 10)
    got = gcdf_prior(distances, 16, 4.0)
    assert (got - torch.stack([gcdf_r(d, 16) for d in distances.tolist()])).abs().max() <= 1e-12
    # eq. 15 as written: lambda / (sigma sqrt(2 pi)) * integral_{-inf}^{d} exp(-x^2 / (2 sigma^2)) dx
    for d in (-5, 0, 3):
        for k in (0, 7, 15):
            sigma = 16 ** (k / 16)
            x = torch.linspace(-60 * sigma, d, 200001, dtype=torch.float64)
            integral = torch.trapezoid(torch.exp(-x ** 2 / (2 * sigma ** 2)), x)
            assert abs(4.0 / (sigma * math.sqrt(2 * math.pi)) * integral - got[d + 9, k]) <= 1e-6
    assert torch.allclose(gcdf_prior(distances, 16, 4.0), 4.0 - gcdf_prior(-distances, 16, 4.0))  # same formula for d < 0


def phi(prior, x, y):
    return (prior[x] - prior[y]).norm().item()


def test_gcdf_satisfies_properties_1_and_2_and_sinusoid_fails_1():
    n, d_model = 40, 64
    distances = torch.arange(0, n + 8)
    for sign in (1, -1):  # "one direction" in the paper; by symmetry the other holds too
        prior = gcdf_prior(sign * distances, d_model, 4.0)
        for i in range(n):
            for j in range(i + 1, n):
                for k in (1, 2, 5):  # property 1: phi(i + k, i) > phi(j + k, j)
                    assert phi(prior, i + k, i) > phi(prior, j + k, j)
                # property 2: increasing and with shrinking increments
                a, b, c = phi(prior, i, j), phi(prior, i, j + 1), phi(prior, i, j + 2)
                assert c > b > a
                assert b - a > c - b
    sinusoid = sinusoidal_prior(distances, d_model)  # translation invariant: property 1 fails
    assert not all(phi(sinusoid, i + 1, i) > phi(sinusoid, i + 2, i + 1) + 1e-9 for i in range(n))


def test_options_parameters_and_reset():
    enc = build_encoding("gcdf", encoding_options(), ModelDims(EMBED, HEADS, 2, 0))
    assert enc.scale == 4.0 and sorted(enc.projections) == ["encoder0", "encoder1"]
    assert sorted(enc.content_bias) == sorted(enc.position_bias) == ["encoder"]
    assert build_encoding("gcdf", encoding_options("--gcdf-lambda", "2.5"), ModelDims(EMBED, HEADS, 1, 1)).scale == 2.5
    assert ENCODINGS["xl"].default_input_positions == ENCODINGS["gcdf"].default_input_positions == "none"
    for name in ("xl", "gcdf"):
        enc = encoding(name)
        enc.reset_to_identity()
        x, padding = inputs(left=False)
        for role, mask in (("encoder", None), ("decoder", causal_mask(len(x)))):
            enc.begin(role)
            got, _ = attention(enc, role, 1)(x, x, x, key_padding_mask=padding, attn_mask=mask)
            expected, _ = attention(None, role, 1)(x, x, x, key_padding_mask=padding, attn_mask=mask)
            assert (got - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("name", ["xl", "gcdf"])
def test_2000_tokens(name):
    torch.manual_seed(0)
    assert_attention_runs_on(build_encoding(name, encoding_options(), ModelDims(32, 4, 3, 3)), (("encoder", 2), ("decoder", 2)))


@pytest.mark.parametrize("arch,extra", [("transformer_xl", []), ("transformer_gcdf", ["--gcdf-lambda", "2"])])
def test_fairseq_train(translation_data, tmp_path, arch, extra):
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", arch, *extra,
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3", "--disable-validation"])
    assert "num_updates 3" in out


@pytest.mark.parametrize("name", ["xl", "gcdf"])
@pytest.mark.parametrize("tq,tk,first", [(6, 6, 0), (3, 8, 5), (4, 4, 2), (2, 9, 7)])
def test_strided_relative_shift_equals_gather_with_gradients(name, tq, tk, first):
    """Consecutive positions (the attention's own, `position_range`) take the strided relative
    shift; any other positions the gather. Same logits, same gradients."""
    enc = encoding(name)
    torch.manual_seed(7)
    q = torch.randn(2, HEADS, tq, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, HEADS, tk, 4, dtype=torch.float64, requires_grad=True)
    weight = enc.projections["encoder1"].weight
    results = []
    for ranged in (False, True):
        enc.begin("encoder")
        q_pos = position_range(first, first + tq) if ranged else torch.arange(first, first + tq)
        k_pos = position_range(0, tk) if ranged else torch.arange(tk)
        logits = logits_between(enc, "encoder", 1, q, k, q_pos, k_pos)
        grads = torch.autograd.grad(logits.pow(2).sum(), [q, k, weight, enc.position_bias["encoder"]])
        results.append((logits.detach(), grads))
    (a, grads_a), (b, grads_b) = results
    assert (a - b).abs().max() <= 1e-12
    for x, y in zip(grads_a, grads_b):
        assert (x - y).abs().max() <= 1e-12


@pytest.mark.parametrize("name", ["xl", "gcdf"])
def test_kept_terms_follow_parameter_changes(name):
    """In inference u, v and W_r R are kept across decoding steps: an in-place change of u, v or
    W_r is seen at the next step (as a training-mode call computes it afresh)."""
    enc = encoding(name)
    torch.manual_seed(6)
    q, k = torch.randn(3, HEADS, 1, 4, dtype=torch.float64), torch.randn(3, HEADS, 7, 4, dtype=torch.float64)
    q_pos, k_pos = position_range(6, 7), position_range(0, 7)

    def step(training=False):
        enc.train(training)
        enc.begin("decoder")
        with torch.no_grad():
            return logits_between(enc, "decoder", 1, q, k, q_pos, k_pos)

    before = step()
    for parameter in (enc.content_bias["decoder"], enc.position_bias["decoder"], enc.projections["decoder1"].weight):
        with torch.no_grad():
            parameter.add_(0.25)
        after = step()
        assert (after - before).abs().max() > 1e-3
        assert (after - step(training=True)).abs().max() <= 1e-12
        before = after


@pytest.mark.parametrize("name", ["xl", "gcdf"])
@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("block", [None, 3], ids=["whole", "query-blocks"])
def test_content_bias_folded_into_the_key_product_gives_the_same_values_and_gradients(name, role, block, monkeypatch):
    """u.k_j is computed as (q + u).k_j by the attention (the plan's `fold_content`): `dense_logits`
    is asked without it, and outputs and every gradient (u's included) equal the unfolded computation."""
    if block is not None:
        monkeypatch.setattr(block_module, "QUERY_BLOCK", block)
        monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    enc = encoding(name)
    module = attention(enc, role, 1)
    x, padding = inputs(left=role == "encoder")
    mask = causal_mask(len(x)) if role == "decoder" else None
    asked = []

    def dense_logits_asked(term, query, key, future_blocked=False, content_folded=False, memoize=None):
        asked.append(content_folded)
        return dense_logits(term, query, key, future_blocked, content_folded, memoize)
    monkeypatch.setattr(terms_module, "dense_logits", dense_logits_asked)

    def run_once():
        parameters = [*module.parameters(), *enc.parameters()]
        for parameter in parameters:
            parameter.grad = None
        enc.begin(role)
        out, _ = module(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=False)
        (out ** 2).sum().backward()
        return out.detach(), [parameter.grad.clone() for parameter in parameters if parameter.grad is not None]

    folded, folded_grads = run_once()
    assert asked and all(asked)
    asked.clear()
    plan = posenc_fairseq.attention.plan
    monkeypatch.setattr(posenc_fairseq.attention, "plan", lambda call: plan(call)._replace(fold_content=False))
    unfolded, unfolded_grads = run_once()
    assert asked and not any(asked)
    assert torch.allclose(folded, unfolded, atol=1e-10)
    assert len(folded_grads) == len(unfolded_grads) and enc.content_bias[role].grad.abs().max() > 0
    for got, expected in zip(folded_grads, unfolded_grads):
        assert torch.allclose(got, expected, atol=1e-10)
