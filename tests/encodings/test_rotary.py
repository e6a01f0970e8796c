"""Rotary embedding against the complex-number form of RoFormer (eq. 13 of Su et al.)."""
import torch

from posenc_fairseq.encodings.rotary import rotate


def assert_complex_form(got, x, first_position: int, heads: int, limit: float, base: float = 10000.0):
    """`got` (T, 1, heads * D) equals x rotated as the complex form (eq. 13), in float64: pairs
    (x_m, x_{m + D/2}) times exp(i p theta_m), theta_m = base^(-2m/D), p = first_position + t; an odd
    D's last dimension unchanged."""
    length, head_dim = x.size(0), x.size(-1) // heads
    half = head_dim // 2
    theta = base ** (-2 * torch.arange(half, dtype=torch.float64) / head_dim)
    for t in range(length):
        for h in range(heads):
            vector = x[t, 0, h * head_dim:(h + 1) * head_dim].double()
            expected = torch.complex(vector[:half], vector[half:2 * half]) * torch.exp(1j * (t + first_position) * theta)
            out = got[t, 0, h * head_dim:(h + 1) * head_dim].double()
            assert (out[:half] - expected.real).abs().max() < limit, (t, h)
            assert (out[half:2 * half] - expected.imag).abs().max() < limit, (t, h)
            if head_dim % 2:
                assert out[-1] == vector[-1], (t, h)


def test_rotation_equals_complex_multiplication():
    heads, head_dim, length = 2, 8, 5
    x = torch.randn(length, 1, heads * head_dim)
    positions = torch.arange(length)[None, :] + 3
    assert_complex_form(rotate(x, positions, heads), x, 3, heads, limit=1e-5)


def test_a_float64_model_rotates_in_float64():
    """Against the complex form in float64 at long positions: float64 rounding, not float32's
    (whose angles p * theta are off by ~1e-5 at p = 600); a float32 input stays in float32."""
    heads, head_dim, length = 2, 8, 4
    x = torch.randn(length, 1, heads * head_dim, dtype=torch.float64)
    positions = torch.arange(length)[None, :] + 600
    got = rotate(x, positions, heads)
    assert got.dtype == torch.float64 and rotate(x.float(), positions, heads).dtype == torch.float32
    assert_complex_form(got, x, 600, heads, limit=1e-12)


def test_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    score = lambda i, j: (rotate(q, torch.tensor([[i]]), 1) * rotate(k, torch.tensor([[j]]), 1)).sum()
    assert torch.allclose(score(2, 7), score(102, 107), atol=1e-4)
    assert not torch.allclose(score(2, 7), score(2, 8), atol=1e-4)


def test_a_decoding_step_rotates_with_one_matrix_equal_to_the_complex_form():
    """A decoding step without padding (one shared position for every row): the encoding rotates
    q and k with one (D, D) matrix per step, equal to the complex multiplication of eq. 13."""
    from posenc_fairseq.encodings import ModelDims, build_encoding
    from posenc_fairseq.encodings.positions import shared_range
    from util import encoding_options

    heads, head_dim, batch, position = 2, 8, 3, 6
    enc = build_encoding("rotary", encoding_options(), ModelDims(heads * head_dim, heads, 1, 1))
    positions = shared_range(batch, position, position + 1)
    enc.begin("decoder", positions, earlier=position)
    x = torch.randn(1, batch, heads * head_dim)
    got = enc.project("decoder", 0, "q", x, positions)  # (the pass context's positions, as the attention passes them)
    memo = enc.cache.pass_values["decoder"]
    assert memo and next(iter(memo.values()))[2] is not None  # the matrix form was taken
    half = head_dim // 2
    theta = 10000.0 ** (-2 * torch.arange(half) / head_dim)
    for b in range(batch):
        for h in range(heads):
            vector = x[0, b, h * head_dim:(h + 1) * head_dim]
            expected = torch.complex(vector[:half], vector[half:]) * torch.exp(1j * position * theta)
            out = got[0, b, h * head_dim:(h + 1) * head_dim]
            assert torch.allclose(out[:half], expected.real, atol=1e-5)
            assert torch.allclose(out[half:], expected.imag, atol=1e-5)


def test_an_odd_head_dim_rotates_its_pairs_and_leaves_the_last_dimension():
    """head_dim 7: pairs (x_m, x_{m+3}) for m = 0..2 rotate as the complex form with
    theta_m = 10000^(-2m/7); the seventh dimension has no partner and is left as it is."""
    heads, head_dim, length = 2, 7, 5
    x = torch.randn(length, 1, heads * head_dim, dtype=torch.float64)
    positions = torch.arange(length)[None, :] + 3
    assert_complex_form(rotate(x, positions, heads), x, 3, heads, limit=1e-12)


def test_a_half_precision_model_rotates_in_float32():
    """fp16 input at positions 600..603 against the complex form in float64 of the same (fp16) values:
    the angles p * theta are taken in float32, within 1e-4 max|x| (float32's rounding: ~1e-6; fp16
    angles are off by up to 0.02 rad there, errors of ~1e-2 max|x|)."""
    heads, head_dim, length = 2, 8, 4
    x = torch.randn(length, 1, heads * head_dim)
    positions = torch.arange(length)[None, :] + 600
    got = rotate(x.half(), positions, heads).float()
    assert_complex_form(got, x.half().double(), 600, heads, limit=1e-4 * x.abs().max().item())


def test_rotary_base_rotates_keys_given_positions_other_than_the_stacks():
    """`project` with a positions tensor of its own (as --cross-self-attention's keys, not the pass
    context's positions) rotates with --rotary-base B: theta_m = B^(-2m/D), here B = 500."""
    from posenc_fairseq.encodings import ModelDims, build_encoding
    from util import encoding_options

    heads, head_dim, length = 2, 8, 5
    enc = build_encoding("rotary", encoding_options("--rotary-base", "500"), ModelDims(heads * head_dim, heads, 1, 1))
    x = torch.randn(length, 1, heads * head_dim, dtype=torch.float64)
    positions = torch.arange(length)[None, :] + 3
    assert_complex_form(enc.project("decoder", 0, "k", x, positions), x, 3, heads, limit=1e-12, base=500.0)
