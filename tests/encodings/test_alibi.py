"""ALiBi against a naive loop over (i, j) from its definition (Press et al., 2022)."""
import math

import pytest
import torch

from posenc_fairseq.encodings import build_encoding
from posenc_fairseq.encodings.alibi import ALiBi, alibi_slopes
from posenc_fairseq.encodings.base import ModelDims
from posenc_fairseq.encodings.prior import prior_distribution
from position_terms import logits_between


def test_slopes_are_the_papers_geometric_sequences():
    # 8 heads: 1/2, 1/4, ..., 1/256 (paper section 3)
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)], dtype=torch.float64))
    # 6 heads: the 4-head slopes, then every other of the 8-head ones
    expected = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert torch.allclose(alibi_slopes(6), torch.tensor(expected, dtype=torch.float64))


def test_bias_equals_naive_loop_including_offset_queries():
    heads = 4
    encoding = ALiBi(None, ModelDims(16, heads, 2, 2))
    for role in ("encoder", "decoder"):
        # queries at positions 3..5 (a decoding step with cache), keys 0..5
        query_positions, key_positions = torch.arange(3, 6), torch.arange(6)
        encoding.begin(role)
        bias = logits_between(encoding, role, 0, None, None, query_positions, key_positions)
        for h in range(heads):
            slope = 2 ** (-8 * (h + 1) / heads)
            for a, i in enumerate(query_positions.tolist()):
                for b, j in enumerate(key_positions.tolist()):
                    assert math.isclose(bias[h, a, b].item(), -slope * abs(i - j), abs_tol=1e-6)
    assert logits_between(encoding, "cross", 0, None, None, torch.arange(2), torch.arange(3)) is None


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_prior_is_the_softmax_of_the_linear_penalty(role):
    """Paper eq. 6 of the AT5 paper for ALiBi: beta_h(j) = exp(-m_h |j - i|) / sum over the
    visible keys (the decoder sees j <= i only); it used to be flat."""
    heads, query = 4, 6
    encoding = ALiBi(None, ModelDims(16, heads, 2, 2))
    for h in range(heads):
        prior = prior_distribution(encoding, role, 1, query, range(15), head=h)
        slope = 2 ** (-8 * (h + 1) / heads)
        visible = [j for j in range(15) if role == "encoder" or j <= query]
        total = sum(math.exp(-slope * abs(j - query)) for j in visible)
        for j in range(15):
            expected = math.exp(-slope * abs(j - query)) / total if j in visible else 0.0
            assert math.isclose(prior[j].item(), expected, rel_tol=1e-5, abs_tol=1e-7)
    cross = prior_distribution(encoding, "cross", 0, query, range(15), head=0)
    assert torch.allclose(cross, torch.full((15,), 1 / 15))


def test_prior_of_encodings_without_a_position_only_bias_is_uniform():
    from util import encoding_options

    for name in ("shaw", "xl", "rotary"):
        encoding = build_encoding(name, encoding_options(), ModelDims(16, 4, 2, 2))
        prior = prior_distribution(encoding, "encoder", 0, 3, range(8), head=0)
        assert torch.allclose(prior, torch.full((8,), 1 / 8))


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_slopes_after_a_round_trip_through_half_precision_are_exact(low):
    """The slopes are a formula, not a state: .half() then .float() gives the exact float32 slopes
    again (12 heads: 2^-0.5... are not representable in half precision), as a fresh model has them;
    before, the rounding stayed (7.6e-5 off, the logits' error growing with distance)."""
    encoding = ALiBi(None, ModelDims(48, 12, 2, 2))
    assert torch.equal(encoding.to(low).slopes, alibi_slopes(12).to(low))
    assert not torch.equal(alibi_slopes(12).to(low).float(), alibi_slopes(12))
    assert torch.equal(encoding.float().slopes, alibi_slopes(12).float()) and encoding.slopes.dtype == torch.float32
    assert torch.equal(encoding.double().slopes, alibi_slopes(12))


@pytest.mark.parametrize("heads", [12, 16])
def test_a_float64_model_has_the_slopes_to_float64_precision(heads):
    """The slopes of Press et al.'s get_slopes (its code, in float64) for 16 heads; for 12, the slopes
    of 8 heads and every other one of 16. Computed in float32 and then widened they were 2e-8 off."""
    def power_of_two(n):  # get_slopes_power_of_2 of the ALiBi repository
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]
    expected = power_of_two(16) if heads == 16 else power_of_two(8) + power_of_two(16)[0::2][:4]
    slopes = ALiBi(None, ModelDims(4 * heads, heads, 2, 2)).double().slopes
    assert slopes.dtype == torch.float64
    assert torch.allclose(slopes, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0)
