"""T5 and T5-NoB scalar biases: bucket ids against an independent reference of the HF algorithm,
the bias each head receives against a naive double loop over (i, j), the prior, long inputs,
identity reset and training through fairseq-train."""
import copy
import math

import pytest
import torch

from posenc_fairseq.encodings import ModelDims, build_encoding
from posenc_fairseq.encodings.prior import prior_distribution
from posenc_fairseq.encodings.t5 import relative_position_bucket
from position_terms import logits_between, position_range
from util import encoding_options, QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, build_model, random_batch, run


def reference_bucket(rp, bidirectional, num_buckets, max_distance):
    """HF T5's bucket of one relative position (key - query), one scalar at a time, as described
    in reference/anchors.md. HF converts the log term to int64 (truncation toward zero), which is
    what int() does. None where HF divides by log(max_distance / max_exact) = log(1) = 0."""
    if bidirectional:
        side = num_buckets // 2
        offset = side if rp > 0 else 0
        n = abs(rp)
    else:
        side, offset, n = num_buckets, 0, max(-rp, 0)
    max_exact = side // 2
    if n < max_exact:
        return offset + n
    if max_distance == max_exact:
        return None
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (side - max_exact))
    return offset + min(large, side - 1)


DISTANCES = torch.arange(-4096, 4097)


@pytest.mark.parametrize("num_buckets", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("max_distance", [16, 64, 128, 512])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_equal_independent_reference(device, num_buckets, max_distance, bidirectional):
    """The buckets computed on the device (CUDA's log and rounding are its own) against the scalar
    reference."""
    got = relative_position_bucket(DISTANCES.to(device), bidirectional, num_buckets, max_distance)
    assert got.dtype == torch.long and got.shape == DISTANCES.shape and got.device == device
    compared = 0
    for rp, bucket in zip(DISTANCES.tolist(), got.tolist()):
        expected = reference_bucket(rp, bidirectional, num_buckets, max_distance)
        if expected is not None:
            assert bucket == expected, (rp, bucket, expected)
            compared += 1
    assert compared >= 2 * 8  # at least the exact buckets of both sides


def test_bucket_function_any_shape_and_known_values(device):
    rp = torch.tensor([[0, 1, -1], [200, -200, 7], [2 ** 20, -(2 ** 20), 99999]], device=device)
    got = relative_position_bucket(rp, True, 32, 128)
    # bidirectional 32/128: 16 buckets a side, 8 exact; beyond 128 (also far beyond: a float32 log of
    # 2^20) the last bucket of the side
    assert got.tolist() == [[0, 17, 1], [31, 15, 23], [31, 15, 31]]
    assert relative_position_bucket(rp, False, 32, 128).tolist() == [[0, 0, 1], [0, 31, 0], [0, 31, 0]]


def make(name, layers=2, heads=4, **options):
    args = encoding_options(**options)
    torch.manual_seed(0)
    return build_encoding(name, args, ModelDims(embed_dim=16, heads=heads, encoder_layers=layers, decoder_layers=layers))


def consecutive_bias(encoding, role, layer, queries: range, keys: range):
    """`logits_between` over consecutive positions: the dense (Toeplitz) form the attention uses.
    dense_logits reads the query and key counts from the tensors (a bias ignores their values)."""
    query, key = torch.zeros(1, 1, len(queries), 0), torch.zeros(1, 1, len(keys), 0)
    return logits_between(encoding, role, layer, query, key, position_range(queries.start, queries.stop),
                          position_range(keys.start, keys.stop))


def naive_t5(table, i, j, bidirectional, num_buckets, max_distance, head):
    """e_h(j - i) = E[b(j - i), h] with b from paper eqs. 14-16 via the scalar reference."""
    return table[reference_bucket(j - i, bidirectional, num_buckets, max_distance), head].item()


def naive_t5_nob(table, i, j, bidirectional, max_distance, head):
    d = j - i
    row = min(max(d, -max_distance), max_distance) + max_distance if bidirectional else min(max(-d, 0), max_distance)
    return table[row, head].item()


@pytest.mark.parametrize("consecutive", [False, True])  # gathered per pair / the dense (Toeplitz) form
@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("name", ["t5", "t5_nob"])
def test_bias_equals_naive_double_loop(name, role, consecutive):
    encoding = make(name, t5_num_buckets=16, t5_max_distance=20)
    table = encoding.tables[role].detach()
    queries, keys = torch.arange(30, 70), torch.arange(0, 100)
    encoding.begin(role)
    if consecutive:
        bias = consecutive_bias(encoding, role, 0, range(30, 70), range(0, 100))
    else:
        bias = logits_between(encoding, role, 0, None, None, queries, keys)
    assert bias.shape == (4, 40, 100)
    for head in range(4):
        for qi, i in enumerate(queries.tolist()):
            for kj, j in enumerate(keys.tolist()):
                if name == "t5":
                    expected = naive_t5(table, i, j, role == "encoder", 16, 20, head)
                else:
                    expected = naive_t5_nob(table, i, j, role == "encoder", 20, head)
                assert bias[head, qi, kj].item() == expected


def test_layers_option_and_cross_attention():
    first = make("t5")
    assert logits_between(first, "cross", 0, None, None, torch.arange(3), torch.arange(5)) is None
    assert logits_between(first, "encoder", 1, None, None, torch.arange(3), torch.arange(5)) is None
    assert sorted(dict(first.named_parameters())) == ["tables.decoder", "tables.encoder"]
    every = make("t5", scalar_bias_layers="all")
    assert sorted(dict(every.named_parameters())) == ["tables.decoder_0", "tables.decoder_1",
                                                      "tables.encoder_0", "tables.encoder_1"]
    every.begin("encoder")
    b0 = logits_between(every, "encoder", 0, None, None, torch.arange(5), torch.arange(5))
    b1 = logits_between(every, "encoder", 1, None, None, torch.arange(5), torch.arange(5))
    assert not torch.equal(b0, b1)
    shared = make("t5", scalar_bias_layers="all", scalar_bias_share_layers=True)
    assert sorted(dict(shared.named_parameters())) == ["tables.decoder", "tables.encoder"]
    shared.begin("encoder")
    # computed once: the per-distance values and their dense form are shared by the layers
    term = shared.distance_term("encoder", 0, -4, 4, 5, torch.float32)
    assert shared.distance_term("encoder", 1, -4, 4, 5, torch.float32).bias is term.bias
    b0 = consecutive_bias(shared, "encoder", 0, range(5), range(5))
    assert consecutive_bias(shared, "encoder", 1, range(5), range(5)) is b0


def test_rejects_max_distance_within_exact_buckets():
    with pytest.raises(ValueError, match="max-distance"):
        make("t5", t5_num_buckets=64, t5_max_distance=16)


def test_max_distance_must_exceed_half_the_buckets():
    """64 buckets: the causal side's exact buckets cover distances below 32, so --t5-max-distance 32
    (log(32 / 32) = 0 in eq. 16) is refused naming the option, and 33 builds."""
    from posenc_fairseq.encodings.option_types import OptionValueError

    with pytest.raises(OptionValueError, match=r"^--t5-max-distance 32: expected an integer > 32 "):
        make("t5", t5_num_buckets=64, t5_max_distance=32)
    encoding = make("t5", t5_num_buckets=64, t5_max_distance=33)
    assert encoding.max_distance == 33 and encoding.tables["decoder"].shape == (64, 4)


def test_tables_start_as_hf_t5s_normal_with_std_one_over_sqrt_d_model():
    """HF T5's initialisation of relative_attention_bias: N(0, d_model^-1/2); d_model 256: std 1/16
    (2 x 1024 x 8 draws: the sample std within 10%)."""
    torch.manual_seed(0)
    encoding = build_encoding("t5", encoding_options(t5_num_buckets=1024, t5_max_distance=2048),
                              ModelDims(embed_dim=256, heads=8, encoder_layers=1, decoder_layers=1))
    values = torch.cat([table.detach().flatten() for table in encoding.tables.values()])
    assert values.numel() == 2 * 1024 * 8
    assert abs(values.std().item() - 1 / 16) < 0.1 / 16, values.std().item()
    assert abs(values.mean().item()) < 0.1 / 16


@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("name", ["t5", "t5_nob"])
def test_prior_sums_to_one(name, role):
    encoding = make(name)
    prior = prior_distribution(encoding, role, 0, 10, torch.arange(40), head=2)
    assert prior.shape == (40,) and abs(prior.sum().item() - 1) < 1e-6
    bias = logits_between(encoding, role, 0, None, None, torch.tensor([10]), torch.arange(40))[2, 0]
    visible = 11 if role == "decoder" else 40
    expected = torch.softmax(bias[:visible], dim=-1)
    assert torch.allclose(prior[:visible], expected) and (prior[visible:] == 0).all()
    uniform = prior_distribution(encoding, role, 1, 10, torch.arange(40), head=2)  # layer without bias
    assert torch.allclose(uniform[:visible], torch.full((visible,), 1 / visible))


def test_odd_bucket_count_refused():
    """Eq. 14 splits B_max between the two directions: an odd count would leave a row unused."""
    from posenc_fairseq.encodings.option_types import OptionValueError

    with pytest.raises(OptionValueError, match=r"^--t5-num-buckets 33: expected an even integer in \[4, "):
        make("t5", t5_num_buckets=33)
    assert make("t5", t5_num_buckets=34, t5_max_distance=40).tables["encoder"].shape == (34, 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_prior_in_the_models_dtype(dtype):
    encoding = make("t5").to(dtype)
    prior = prior_distribution(encoding, "encoder", 0, 7, range(20), head=1)
    table = encoding.tables["encoder"]
    rows = relative_position_bucket(torch.arange(20) - 7, True, 32, 128)
    expected = torch.softmax(table[rows, 1].float(), dim=-1)  # the bias the model adds, in its dtype
    assert prior.dtype == torch.float32 and torch.allclose(prior, expected, atol=1e-6)


@pytest.mark.parametrize("name", ["t5", "at5"])
def test_prior_follows_the_parameters_between_passes(name):
    """The prior outside a forward pass reads the bias kept in inference, which is checked against
    the parameters: after a pass and a prior, an in-place change and a load_state_dict each give the
    prior of a copy that never kept anything. (Before, both gave the kept, stale prior.)"""
    encoding = make(name)
    other = make(name)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    encoding.eval()
    with torch.no_grad():
        encoding.begin("encoder")
        encoding.distance_term("encoder", 0, -9, 9, 10, torch.float32)  # kept in inference
    before = prior_distribution(encoding, "encoder", 0, 7, range(20), head=1)
    changes = [lambda: [parameter.data.mul_(1.5) for parameter in encoding.parameters()],
               lambda: encoding.load_state_dict(other.state_dict())]
    for change in changes:
        change()
        fresh = copy.deepcopy(encoding)  # (copies start with an empty cache)
        prior = prior_distribution(encoding, "encoder", 0, 7, range(20), head=1)
        assert torch.equal(prior, prior_distribution(fresh, "encoder", 0, 7, range(20), head=1))
        assert (prior - before).abs().max() > 1e-3
        before = prior


def test_reset_to_identity_adds_zero():
    for name in ("t5", "t5_nob"):
        encoding = make(name)
        encoding.reset_to_identity()
        encoding.begin("encoder")
        assert (logits_between(encoding, "encoder", 0, None, None, torch.arange(9), torch.arange(9)) == 0).all()


@pytest.mark.parametrize("name", ["t5", "t5_nob"])
def test_distances_beyond_training_use_the_last_bucket(translation_data, name):
    """A model trained on short sequences runs on 1000 tokens; every distance beyond max_distance
    gets the bias of the last bucket (t5) / the clipped distance (t5_nob) of its side."""
    model, task, _ = build_model(translation_data, f"transformer_{name}", [*TINY_TRANSFORMER, "--t5-max-distance", "32"])
    model.eval()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=1, src_len=1000, tgt_len=1000)
    with torch.no_grad():
        logits, _ = model(src, src_lengths, prev)
        assert torch.isfinite(logits).all()
        encoding = model.positional_encoding
        positions = torch.arange(1000)
        bias = logits_between(encoding, "encoder", 0, None, None, positions, positions)
        table = encoding.tables["encoder"]
        far_right, far_left = table[-1] if name == "t5_nob" else table[31], table[0] if name == "t5_nob" else table[15]
        relative = positions[None, :] - positions[:, None]
        assert torch.isfinite(bias).all()
        assert (bias.permute(1, 2, 0)[relative >= 32] == far_right).all()
        assert (bias.permute(1, 2, 0)[relative <= -32] == far_left).all()
        causal = logits_between(encoding, "decoder", 0, None, None, positions, positions).permute(1, 2, 0)
        last = encoding.tables["decoder"][-1]
        assert (causal[relative <= -32] == last).all()


def test_training_gradients_reach_the_table(translation_data):
    model, task, _ = build_model(translation_data, "transformer_t5", TINY_TRANSFORMER)
    src, src_lengths, prev = random_batch(task.source_dictionary)
    logits, _ = model(src, src_lengths, prev)
    logits.logsumexp(-1).mean().backward()
    for name, parameter in model.positional_encoding.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("arch", ["transformer_t5", "transformer_t5_nob"])
def test_fairseq_train_translation(translation_data, tmp_path, arch):
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", arch, *TINY_TRANSFORMER,
               *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3", "--scalar-bias-layers", "all"])
    assert "num_updates 3" in out


@pytest.mark.parametrize("arch", ["roberta_t5", "roberta_t5_nob"])
def test_fairseq_train_roberta(masked_lm_data, tmp_path, arch):
    out = run(["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, "--task", "masked_lm", "--arch", arch,
               "--tokens-per-sample", "64", *TINY_ROBERTA, *QUICK_TRAIN, "--save-dir", tmp_path, "--max-update", "3"])
    assert "num_updates 3" in out
