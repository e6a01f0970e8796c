"""ALiBi against a naive loop over (i, j) from its definition (Press et al., 2022)."""
import math

import torch

from posenc_fairseq.encodings.alibi import ALiBi, alibi_slopes
from posenc_fairseq.encodings.base import ModelDims


def test_slopes_are_the_papers_geometric_sequences():
    # 8 heads: 1/2, 1/4, ..., 1/256 (paper section 3)
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)]))
    # 6 heads: the 4-head slopes, then every other of the 8-head ones
    expected = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert torch.allclose(alibi_slopes(6), torch.tensor(expected))


def test_bias_equals_naive_loop_including_offset_queries():
    heads = 4
    encoding = ALiBi(None, ModelDims(16, heads, 2, 2))
    for role in ("encoder", "decoder"):
        # queries at positions 3..5 (a decoding step with cache), keys 0..5
        query_positions, key_positions = torch.arange(3, 6), torch.arange(6)
        encoding.begin(role)
        bias = encoding.logit_bias(role, 0, query_positions, key_positions)
        for h in range(heads):
            slope = 2 ** (-8 * (h + 1) / heads)
            for a, i in enumerate(query_positions.tolist()):
                for b, j in enumerate(key_positions.tolist()):
                    assert math.isclose(bias[h, a, b].item(), -slope * abs(i - j), abs_tol=1e-6)
    assert encoding.logit_bias("cross", 0, torch.arange(2), torch.arange(3)) is None
