"""Rotary embedding against the complex-number form of RoFormer (eq. 13 of Su et al.)."""
import torch

from posenc_fairseq.encodings.rotary import rotate


def test_rotation_equals_complex_multiplication():
    heads, head_dim, length = 2, 8, 5
    x = torch.randn(length, 1, heads * head_dim)
    positions = torch.arange(length)[None, :] + 3
    got = rotate(x, positions, heads)
    half = head_dim // 2
    for t in range(length):
        for h in range(heads):
            vector = x[t, 0, h * head_dim:(h + 1) * head_dim]
            z = torch.complex(vector[:half], vector[half:])
            theta = 10000.0 ** (-2 * torch.arange(half) / head_dim)
            expected = z * torch.exp(1j * (t + 3) * theta)
            out = got[t, 0, h * head_dim:(h + 1) * head_dim]
            assert torch.allclose(out[:half], expected.real, atol=1e-5)
            assert torch.allclose(out[half:], expected.imag, atol=1e-5)


def test_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    score = lambda i, j: (rotate(q, torch.tensor([[i]]), 1) * rotate(k, torch.tensor([[j]]), 1)).sum()
    assert torch.allclose(score(2, 7), score(102, 107), atol=1e-4)
    assert not torch.allclose(score(2, 7), score(2, 8), atol=1e-4)
