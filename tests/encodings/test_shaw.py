"""Shaw-RPE and LFHC-RPE against naive (i, j) loops written straight from the papers' equations."""
import math

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.kernels import blocks as block_module, explicit as explicit_module, step as step_module, terms as terms_module
from posenc_fairseq.encodings import ENCODINGS, ModelDims, build_encoding, distance
from posenc_fairseq.encodings.distance import DistanceTerm, dense_logits, distance_range, rows_of
from position_terms import logits_between, position_range
from util import attention_steps, count_calls, assert_attention_runs_on, bound_attention, encoding_options, perturbed_encoding, QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, run

EMBED, HEADS, LAYERS = 16, 4, 3


def encoding(name, *argv, seed=1):
    return perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, LAYERS, LAYERS), seed=seed)


def attention(enc, role, layer, embed=EMBED, heads=HEADS, dtype=torch.float64):
    return bound_attention(enc, role, layer, embed, heads, dtype)


def inputs(length=8, batch=2):
    torch.manual_seed(2)
    x = torch.randn(length, batch, EMBED, dtype=torch.float64)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, -3:] = True  # right padding in row 0 (no query row is fully masked)
    return x, padding


def causal_mask(length):
    return torch.triu(torch.full((length, length), float("-inf"), dtype=torch.float64), 1)


# --- the papers' clip functions, written case by case ------------------------------------------
def shaw_clip(x, k):
    return max(-k, min(k, x))


def lfhc_clip(x, k, l):
    """Eq. 9 of Qu et al. (2021), literally."""
    if x > k * l:
        return k
    if 0 <= x <= k * l:
        return math.floor(x / l)
    if -k * l <= x < 0:
        return math.floor(x / l)
    return -k


def naive(module, x, padding, causal, w_key, w_value, clip):
    """z_i = sum_j alpha_ij (v_j + a^V_ij), alpha = softmax_j(q_i.(k_j + a^K_ij) / sqrt(d)),
    a_ij = w[clip(i, j)] (w indexed -k..k; Shaw: clip(j - i), LFHC: clip^l(i - j)), one (i, j)
    pair at a time."""
    length, batch, embed = x.shape
    heads = module.num_heads
    d = embed // heads
    k_max = (w_key.size(0) - 1) // 2
    q, k, v = module.q_proj(x), module.k_proj(x), module.v_proj(x)
    z = torch.zeros(length, batch, embed, dtype=x.dtype)
    for b in range(batch):
        for h in range(heads):
            part = slice(h * d, (h + 1) * d)
            for i in range(length):
                e = []
                for j in range(length):
                    a_key = w_key[clip(i, j) + k_max]
                    score = q[i, b, part] @ (k[j, b, part] + a_key) / math.sqrt(d)
                    if padding[b, j] or (causal and j > i):
                        score = torch.tensor(float("-inf"), dtype=x.dtype)
                    e.append(score)
                alpha = torch.softmax(torch.stack(e), dim=0)
                for j in range(length):
                    a_value = w_value[clip(i, j) + k_max] if w_value is not None else 0
                    z[i, b, part] += alpha[j] * (v[j, b, part] + a_value)
    return module.out_proj(z)


CASES = [
    ("shaw", 0), ("shaw", 2), ("lfhc", 0), ("lfhc", 1), ("lfhc", 2),
]


@pytest.mark.parametrize("name,layer", CASES)
@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("values", ["on", "off"])
@pytest.mark.parametrize("block", [None, 3], ids=["whole", "query-blocks"])
def test_attention_output_equals_naive_loops(name, layer, role, values, block, monkeypatch):
    """block 3: the attention computes the relative terms 3 queries at a time (long-input path)."""
    if block is not None:
        monkeypatch.setattr(block_module, "QUERY_BLOCK", block)
        monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    k = 2  # small, so that clipping happens within 8 tokens (LFHC layer 3: |x| > 6)
    enc = encoding(name, f"--{name}-k", str(k), f"--{name}-values", values)
    module = attention(enc, role, layer)
    x, padding = inputs()
    causal = role == "decoder"
    enc.begin(role)
    got, _ = module(x, x, x, key_padding_mask=padding, attn_mask=causal_mask(len(x)) if causal else None)
    key = f"{role}{layer}"
    w_value = enc.value_tables[key] if values == "on" else None
    # Shaw et al. index by key - query; Qu et al.'s eqs. 5 and 9 by x = i - j (query - key)
    clip = (lambda i, j: shaw_clip(j - i, k)) if name == "shaw" else (lambda i, j: lfhc_clip(i - j, k, layer + 1))
    with torch.no_grad():
        expected = naive(module, x, padding, causal, enc.key_tables[key], w_value, clip)
    assert (got - expected).abs().max() <= 1e-5
    # and the position terms matter (the comparison above can fail)
    plain = attention(None, role, layer)
    baseline, _ = plain(x, x, x, key_padding_mask=padding, attn_mask=causal_mask(len(x)) if causal else None)
    assert (got - baseline).abs().max() > 1e-3


@pytest.mark.parametrize("name,layer", CASES)
@pytest.mark.parametrize("values", ["on", "off"])
def test_decoding_steps_fold_the_terms_into_keys_and_values_and_equal_naive_loops(name, layer, values, monkeypatch):
    """One query at a time (incremental decoding): a^K and a^V depend on the key alone, so each step
    adds them to the cached keys and values (`step_terms`) and runs plain attention, without the
    dense logit and value forms; every step equals the naive loops' row."""
    k = 2
    enc = encoding(name, f"--{name}-k", str(k), f"--{name}-values", values)
    module = attention(enc, "decoder", layer)
    x, _ = inputs()
    no_padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    clip = (lambda i, j: shaw_clip(j - i, k)) if name == "shaw" else (lambda i, j: lfhc_clip(i - j, k, layer + 1))
    key = f"decoder{layer}"
    with torch.no_grad():
        expected = naive(module, x, no_padding, True, enc.key_tables[key],
                         enc.value_tables[key] if values == "on" else None, clip)
    used = count_calls(monkeypatch, [(step_module, "step_terms"), (terms_module, "dense_logits"),
                                     (explicit_module, "dense_values"), (distance, "dense_logits"),
                                     (distance, "dense_values")])
    steps = attention_steps(module, enc, x)
    assert used == ["step_terms"] * len(x)
    assert (steps - expected).abs().max() <= 1e-5


def test_options_and_defaults():
    enc = build_encoding("shaw", encoding_options(), ModelDims(EMBED, HEADS, 2, 3))
    assert enc.k == 16 and enc.values  # Shaw et al.'s full model: value term on
    assert sorted(enc.key_tables) == ["decoder0", "decoder1", "decoder2", "encoder0", "encoder1"]
    assert enc.key_tables["encoder0"].shape == (33, EMBED // HEADS)
    lfhc = build_encoding("lfhc", encoding_options(), ModelDims(EMBED, HEADS, 2, 3))
    # Qu et al.'s eqs. 5 and 9: key term only by default, floor rounding
    assert lfhc.k == 16 and not lfhc.values and len(lfhc.value_tables) == 0 and lfhc.rounding == "floor"
    off = build_encoding("lfhc", encoding_options("--lfhc-k", "4", "--lfhc-values", "off"), ModelDims(EMBED, HEADS, 2, 0))
    assert off.k == 4 and not off.values and len(off.value_tables) == 0 and sorted(off.key_tables) == ["encoder0", "encoder1"]
    assert off.value_term("encoder", 0, -2, 2, 3, torch.float32) is None
    on = build_encoding("lfhc", encoding_options("--lfhc-values", "on"), ModelDims(EMBED, HEADS, 2, 3))
    assert on.values and on.value_term("encoder", 0, -2, 2, 3, torch.float32) is not None
    assert sum(p.numel() for p in enc.parameters()) == sum(p.numel() for p in on.parameters())
    assert ENCODINGS["shaw"].default_input_positions == ENCODINGS["lfhc"].default_input_positions == "none"


def test_lfhc_layer_one_equals_shaw_and_higher_layers_differ():
    shaw = encoding("shaw", "--shaw-k", "2", "--shaw-values", "off")
    lfhc = encoding("lfhc", "--lfhc-k", "2")
    # LFHC indexes by i - j, Shaw by j - i: layer 1 is Shaw with the table's rows reversed
    lfhc.load_state_dict({key: value.flip(0) for key, value in shaw.state_dict().items()})
    x, padding = inputs()
    outputs = {}
    for layer in (0, 1):
        for name, enc in (("shaw", shaw), ("lfhc", lfhc)):
            enc.begin("encoder")
            outputs[name, layer], _ = attention(enc, "encoder", layer)(x, x, x, key_padding_mask=padding)
    assert (outputs["shaw", 0] - outputs["lfhc", 0]).abs().max() <= 1e-12
    assert (outputs["shaw", 1] - outputs["lfhc", 1]).abs().max() > 1e-3


# eq. 9 by hand for k = 2 and positions 0..5, entry [i][j] = clip^l(i - j, 2) (query - key, eq. 5)
LAYER_2 = [
    [0, -1, -1, -2, -2, -2],
    [0, 0, -1, -1, -2, -2],
    [1, 0, 0, -1, -1, -2],
    [1, 1, 0, 0, -1, -1],
    [2, 1, 1, 0, 0, -1],
    [2, 2, 1, 1, 0, 0],
]
LAYER_3 = [
    [0, -1, -1, -1, -2, -2],
    [0, 0, -1, -1, -1, -2],
    [0, 0, 0, -1, -1, -1],
    [1, 0, 0, 0, -1, -1],
    [1, 1, 0, 0, 0, -1],
    [1, 1, 1, 0, 0, 0],
]
# the symmetric reading (truncation toward zero), layer 2: {-1, 0, 1} share bucket 0
LAYER_2_TRUNC = [
    [0, 0, -1, -1, -2, -2],
    [0, 0, 0, -1, -1, -2],
    [1, 0, 0, 0, -1, -1],
    [1, 1, 0, 0, 0, -1],
    [2, 1, 1, 0, 0, 0],
    [2, 2, 1, 1, 0, 0],
]


def test_lfhc_index_matrix_is_eq_9():
    enc = encoding("lfhc", "--lfhc-k", "2")
    positions = torch.arange(6)
    for layer, expected in ((1, LAYER_2), (2, LAYER_3)):  # 0-based layer index: l = 2, 3
        assert (enc.bucket_of(positions, positions, layer) - 2).tolist() == expected
    # the example: at layer 2, keys after the query (j - i = 1, 2, ...) group as {0}, {1, 2}, {3, 4}
    assert (enc.bucket_of(torch.tensor([0]), positions[:5], 1) - 2).tolist() == [[0, -1, -1, -2, -2]]
    # layer 1 is the paper's Shaw clip(i - j, k); last query row of a step-by-step call matches the full matrix
    assert (enc.bucket_of(positions, positions, 0) - 2).tolist() == [
        [shaw_clip(i - j, 2) for j in range(6)] for i in range(6)]
    assert (enc.bucket_of(positions[-1:], positions, 1) - 2).tolist() == [LAYER_2[-1]]
    # distance_runs(): the rows the call's key - query distances use and each distance's row
    # relative to the first of them
    enc.begin("encoder")
    low, high = distance_range(positions, positions)
    runs, first, last = enc.distance_runs("encoder", 1, low, high)
    assert (low, high) == (-5, 5) and (first, last) == (0, 4) and enc.row_bounds(low, high, 1) == (0, 4)
    index = rows_of(DistanceTerm(low, high, rows=runs), positions[None, :] - positions[:, None])
    assert (index + first - 2).tolist() == LAYER_2
    trunc = encoding("lfhc", "--lfhc-k", "2", "--lfhc-rounding", "trunc")
    assert (trunc.bucket_of(positions, positions, 1) - 2).tolist() == LAYER_2_TRUNC
    assert (trunc.bucket_of(positions, positions, 0) - 2).tolist() == [
        [shaw_clip(i - j, 2) for j in range(6)] for i in range(6)]


@pytest.mark.parametrize("name", ["shaw", "lfhc"])
def test_large_k_uses_only_the_rows_of_the_call(name, monkeypatch):
    """k far beyond the length: only the rows of the call's distances enter the product."""
    k = 50
    enc = encoding(name, f"--{name}-k", str(k), f"--{name}-values", "on")
    module = attention(enc, "encoder", 1)
    x, padding = inputs()
    terms = []
    for hook in ("distance_term", "value_term"):
        original = getattr(type(enc), hook)
        monkeypatch.setattr(type(enc), hook, lambda self, *a, original=original: terms.append(original(self, *a)) or terms[-1])
    enc.begin("encoder")
    got, _ = module(x, x, x, key_padding_mask=padding)
    clip = (lambda i, j: shaw_clip(j - i, k)) if name == "shaw" else (lambda i, j: lfhc_clip(i - j, k, 2))
    with torch.no_grad():
        expected = naive(module, x, padding, False, enc.key_tables["encoder1"], enc.value_tables["encoder1"], clip)
    assert (got - expected).abs().max() <= 1e-5
    # the key and the value term of the call: (1, rows, D) with the rows of distances -7..7 alone
    assert len(terms) == 2 and all(term.vectors.size(1) <= 15 < 2 * k + 1 for term in terms)
    first, last = enc.row_bounds(-7, 7, 1)
    for term, table in zip(terms, (enc.key_tables["encoder1"], enc.value_tables["encoder1"])):
        assert (term.low, term.high) == (-7, 7) and torch.equal(term.vectors[0], table[first: last + 1])


def test_reset_to_identity_adds_nothing():
    for name in ("shaw", "lfhc"):
        enc = encoding(name)
        enc.reset_to_identity()
        x, padding = inputs()
        enc.begin("decoder")
        got, _ = attention(enc, "decoder", 1)(x, x, x, key_padding_mask=padding, attn_mask=causal_mask(len(x)))
        expected, _ = attention(None, "decoder", 1)(x, x, x, key_padding_mask=padding, attn_mask=causal_mask(len(x)))
        assert (got - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("name", ["shaw", "lfhc"])
def test_2000_tokens(name):
    torch.manual_seed(0)
    assert_attention_runs_on(build_encoding(name, encoding_options(), ModelDims(32, 4, 3, 3)), (("encoder", 2), ("decoder", 2)))


@pytest.mark.parametrize("arch,extra", [
    ("transformer_shaw", ["--shaw-k", "4", "--shaw-values", "off"]),
    ("transformer_lfhc", []),
])
def test_fairseq_train(translation_data, tmp_path, arch, extra):
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", arch, *extra,
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3", "--disable-validation"])
    assert "num_updates 3" in out


def test_fairseq_train_roberta_shaw(masked_lm_data, tmp_path):
    out = run(["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, "--task", "masked_lm",
               "--criterion", "masked_lm", "--arch", "roberta_shaw", "--tokens-per-sample", "64",
               *TINY_ROBERTA, *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3", "--disable-validation"])
    assert "num_updates 3" in out


@pytest.mark.parametrize("name,argv", [("shaw", []), ("lfhc", []), ("lfhc", ["--lfhc-rounding", "trunc"])])
def test_row_bounds_are_the_rows_min_and_max(name, argv):
    """The rows a call uses, found from its key - query distances' bounds without a device sync,
    are exactly the min and max of its index matrix."""
    enc = encoding(name, f"--{name}-k", "3", *argv)
    for layer in range(LAYERS):
        for q_low, q_high, k_low, k_high in [(0, 9, 0, 9), (5, 5, 0, 5), (0, 2, 4, 30), (20, 40, 0, 3), (7, 7, 7, 7)]:
            rows = enc.bucket_of(torch.arange(q_low, q_high + 1), torch.arange(k_low, k_high + 1), layer)
            low, high = k_low - q_high, k_high - q_low
            assert enc.row_bounds(low, high, layer) == (int(rows.min()), int(rows.max()))


@pytest.mark.parametrize("name,argv", [("shaw", []), ("lfhc", []), ("lfhc", ["--lfhc-rounding", "trunc"])])
@pytest.mark.parametrize("tq,tk,first", [(6, 6, 0), (3, 8, 5), (4, 4, 2), (2, 9, 7)])
@pytest.mark.parametrize("layer", [0, 2])
def test_strided_relative_shift_equals_gather_with_gradients(name, argv, tq, tk, first, layer):
    """Consecutive positions (the attention's own, `position_range`) take per-distance rows and
    the strided relative shift; any other positions the (Tq, Tk) gather. Same logits and gradients."""
    enc = encoding(name, f"--{name}-k", "2", *argv)
    torch.manual_seed(7)
    q = torch.randn(2, HEADS, tq, EMBED // HEADS, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, HEADS, tk, EMBED // HEADS, dtype=torch.float64)
    table = enc.key_tables[f"decoder{layer}"]
    results = []
    for ranged in (False, True):
        enc.begin("decoder")
        q_pos = position_range(first, first + tq) if ranged else torch.arange(first, first + tq)
        k_pos = position_range(0, tk) if ranged else torch.arange(tk)
        logits = logits_between(enc, "decoder", layer, q, k, q_pos, k_pos)
        results.append((logits.detach(), torch.autograd.grad(logits.pow(2).sum(), [q, table])))
    (a, grads_a), (b, grads_b) = results
    assert (a - b).abs().max() <= 1e-12
    for x, y in zip(grads_a, grads_b):
        assert (x - y).abs().max() <= 1e-12


@pytest.mark.parametrize("name,argv", [("shaw", []), ("lfhc", [])])
@pytest.mark.parametrize("tq,tk", [(6, 6), (4, 9), (2, 5)])
def test_future_blocked_logits_agree_where_not_blocked(name, argv, tq, tk):
    """Under the future mask (queries the last of the keys) only the distances high..-1 are taken:
    the same logits and gradients for every key up to its query."""
    enc = encoding(name, f"--{name}-k", "2", *argv)
    torch.manual_seed(8)
    q = torch.randn(2, HEADS, tq, EMBED // HEADS, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, HEADS, tk, EMBED // HEADS, dtype=torch.float64)
    seen = torch.arange(tk - tq, tk)[:, None] >= torch.arange(tk)[None, :]
    results = []
    for future_blocked in (False, True):
        enc.begin("decoder")
        low, high = distance_range(position_range(tk - tq, tk), position_range(0, tk))
        term = enc.distance_term("decoder", 1, low, high, tq, q.dtype)
        logits = dense_logits(term, q, k, future_blocked=future_blocked)
        assert torch.isfinite(logits).all()
        results.append((logits.detach(), torch.autograd.grad(logits[..., seen].pow(2).sum(), q)[0]))
    (full, full_grad), (cut, cut_grad) = results
    assert (full - cut).abs()[..., seen].max() <= 1e-12
    assert (full_grad - cut_grad).abs().max() <= 1e-12


@pytest.mark.parametrize("name,layer", [("shaw", 0), ("lfhc", 1)])
def test_rows_kept_across_decoding_steps_follow_the_clipping_distance(name, layer):
    """The rows a decoding step keeps across steps are recomputed when k, the clip they are the rows
    of, is another (set on the encoding after a decode): the steps equal the naive loops with the new k
    (before: the rows of the old k, 1.1 apart)."""
    enc = encoding(name, f"--{name}-k", "4").eval()  # (kept rows: in inference)
    module = attention(enc, "decoder", layer)
    x, _ = inputs()
    attention_steps(module, enc, x)  # rows of k = 4 kept
    enc.k = 1
    no_padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    clip = (lambda i, j: shaw_clip(j - i, 1)) if name == "shaw" else (lambda i, j: lfhc_clip(i - j, 1, layer + 1))
    key = f"decoder{layer}"
    with torch.no_grad():
        rows = slice(0, 2 * 1 + 1)  # the rows -1..1 of the tables, as k = 1 reads them
        values = enc.value_tables[key][rows] if key in enc.value_tables else None
        expected = naive(module, x, no_padding, True, enc.key_tables[key][rows], values, clip)
    assert (attention_steps(module, enc, x) - expected).abs().max() <= 1e-5


def test_rows_kept_for_one_query_follow_the_lfhc_rounding():
    """A one-query term in inference (a prior's, a plot's) keeps its rows across calls; set to trunc
    after a call, LFHC's rows of keys after the query (x = i - j < 0, where floor and trunc differ)
    are recomputed: the logits equal q . w^K[clip(trunc(x / l), k)] with l = 2 (the second layer)."""
    enc = encoding("lfhc", "--lfhc-k", "4").eval()  # (kept rows: in inference)
    torch.manual_seed(3)
    query = torch.randn(1, HEADS, 1, EMBED // HEADS, dtype=torch.float64)
    keys = torch.arange(20)
    with torch.no_grad():
        enc.begin("encoder")
        before = logits_between(enc, "encoder", 1, query, None, torch.tensor([10]), keys)  # floor's rows kept
        enc.rounding = "trunc"
        enc.begin("encoder")
        after = logits_between(enc, "encoder", 1, query, None, torch.tensor([10]), keys)
        table = enc.key_tables["encoder1"]
        rows = [max(-4, min(4, int((10 - j) / 2))) + 4 for j in keys.tolist()]  # int(): toward zero
        expected = query[0, :, 0] @ table[rows].T  # (heads, keys)
    assert (after[0, :, 0] - expected).abs().max() <= 1e-12
    assert (after - before).abs().max() > 1e-3
