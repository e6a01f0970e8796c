"""positions.py helpers against plain indexing."""
import random

import pytest
import torch

from posenc_fairseq.encodings.cache import range_values
from posenc_fairseq.encodings.positions import row_runs, take_runs
from position_terms import position_range


@pytest.mark.parametrize("rows, pieces", [
    ([0, 0, 0, 1, 2, 3, 4, 4, 4], [(0, 3, 0), (1, 4, 1), (4, 2, 0)]),  # Shaw: clipped ends, band
    ([5, 4, 3, 2, 1, 1, 1], [(5, 5, -1), (1, 2, 0)]),  # descending band (LFHC at layer 1)
    ([3, 3, 2, 2, 1, 1], [(3, 2, 0), (2, 2, 0), (1, 2, 0)]),  # LFHC at layer 2: each row twice
    ([7], [(7, 1, 0)]),
])
def test_row_runs_hand_computed(rows, pieces):
    assert row_runs(rows) == pieces


def test_take_runs_equals_index_select_with_gradients():
    generator = random.Random(0)
    for _ in range(200):
        width = generator.randint(1, 6)
        rows = [generator.randrange(width) for _ in range(generator.randint(1, 15))]
        values = torch.randn(2, 3, width, dtype=torch.float64, requires_grad=True)
        expected = values.index_select(-1, torch.tensor(rows))
        got = take_runs(values, row_runs(rows))
        assert torch.equal(got, expected), rows
        weights = torch.randn_like(expected)
        (grad,) = torch.autograd.grad((got * weights).sum(), values)
        (expected_grad,) = torch.autograd.grad((expected * weights).sum(), values)
        assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12), rows


def test_range_values_slices_what_it_keeps():
    calls = []

    def compute(first, last):
        calls.append((first, last))
        return torch.arange(first, last + 1).double() ** 2

    cache = {}
    for low, high in [(0, 3), (0, 4), (-2, 4), (1, 2), (0, 9)]:
        got = range_values(cache, "key", ("same",), low, high, compute, dim=0)
        assert torch.equal(got, torch.arange(low, high + 1).double() ** 2), (low, high)
    assert len(calls) < 5  # (1, 2) and some growth steps were slices of what was kept


def test_position_range_knows_its_bounds():
    positions = position_range(3, 7)
    assert positions.tensor.tolist() == [3, 4, 5, 6] and (positions.start, positions.stop) == (3, 7)


def test_token_positions_are_a_shared_range_without_padding_or_with_right_padding():
    """Hand-computed positions among each row's real tokens; a batch without padding, or right-padded
    with one full row, gets a `shared_range` (the same 0..T-1 in every row, bounds known), other
    padding `PaddedPositions` with the longest row's count (its bounds known too)."""
    from posenc_fairseq.encodings.positions import PaddedPositions, bounds, is_shared_range, shared_range
    from posenc_fairseq.models.common import token_positions

    pad = 1
    unpadded = token_positions(torch.tensor([[5, 6, 7], [8, 9, 2]]), pad)
    assert unpadded.tensor.tolist() == [[0, 1, 2], [0, 1, 2]] and is_shared_range(unpadded)
    assert (unpadded.start, unpadded.stop) == (0, 3)
    padded = token_positions(torch.tensor([[1, 1, 7], [8, 9, 1]]), pad)  # left- and right-padded rows
    assert isinstance(padded, PaddedPositions) and not is_shared_range(padded)
    assert padded.tensor.tolist() == [[0, 0, 0], [0, 1, 0]] and bounds(padded) == (0, 1)
    left = token_positions(torch.tensor([[1, 1, 7, 8], [1, 5, 6, 2]]), pad)  # every row left-padded
    assert left.tensor.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]] and bounds(left) == (0, 2)
    only_pads = token_positions(torch.tensor([[1, 1], [1, 1]]), pad)  # (pads are at position 0)
    assert only_pads.tensor.tolist() == [[0, 0], [0, 0]] and bounds(only_pads) == (0, 0)
    # right padding with one full row: the real tokens' positions are the range's (pads continue it)
    right = token_positions(torch.tensor([[5, 1, 1], [8, 9, 2]]), pad)
    assert is_shared_range(right) and right.tensor[0, 0] == 0 and right.tensor[1].tolist() == [0, 1, 2]
    every_row_padded = token_positions(torch.tensor([[5, 1, 1], [8, 9, 1]]), pad)  # (the range would pass them)
    assert every_row_padded.tensor.tolist() == [[0, 0, 0], [0, 1, 0]] and not is_shared_range(every_row_padded)
    assert bounds(every_row_padded) == (0, 1)
    step = shared_range(3, 4, 5)  # a decoding step at position 4
    assert step.tensor.tolist() == [[4]] * 3 and (step.start, step.stop) == (4, 5) and is_shared_range(step)
    assert not is_shared_range(position_range(0, 3))  # 1-D: a stack's own positions, not per row


def test_first_of_each_beam_keeps_what_the_host_knows():
    """fairseq's beamable cross-attention keeps one source row per sentence: the first of its `beam`
    rows (hand-picked here), as the same kind of value with the same bounds."""
    from posenc_fairseq.attention import first_of_each_beam
    from posenc_fairseq.encodings.positions import PaddedPositions, bounds, is_shared_range, shared_range

    shared = first_of_each_beam(shared_range(6, 0, 4), beam=3)
    assert is_shared_range(shared) and (shared.rows, shared.start, shared.stop) == (2, 0, 4)
    rows = torch.tensor([[0, 0, 1], [0, 0, 1], [0, 1, 2], [0, 1, 2]])  # 2 sentences x beam 2, left-padded
    padded = first_of_each_beam(PaddedPositions(rows, 3), beam=2)
    assert isinstance(padded, PaddedPositions) and padded.tensor.tolist() == [[0, 0, 1], [0, 1, 2]]
    assert bounds(padded) == (0, 2)
    plain = first_of_each_beam(rows + 5, beam=2)
    assert isinstance(plain, torch.Tensor) and plain.tolist() == [[5, 5, 6], [5, 6, 7]]


@pytest.mark.parametrize("queries,keys", [(1, 5), (5, 1), (4, 4), (3, 7), (7, 3)])
def test_toeplitz_equals_index_by_distance_with_gradients(queries, keys):
    from posenc_fairseq.encodings.positions import toeplitz

    values = torch.randn(2, 3, queries + keys - 1, dtype=torch.float64, requires_grad=True)
    distance = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]  # key - query
    expected = values[..., distance + queries - 1]
    got = toeplitz(values, queries)
    assert torch.equal(got, expected)
    weights = torch.randn_like(expected)
    (grad,) = torch.autograd.grad((got * weights).sum(), values)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), values)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch,queries,keys,columns", [
    (1, 40, 40, None), (3, 40, 40, None), (2, 37, 50, None), (1, 1, 5, None), (2, 17, 17, None),
    (1, 40, 40, 41), (2, 37, 50, 51), (2, 33, 33, 34)])  # columns = keys + 1: the future mask's distances
def test_shifted_product_equals_the_product_at_each_pairs_distance(monkeypatch, batch, queries, keys, columns):
    """out[i, j] = q_i . rel[Tq - 1 - i + j], in chunks of 16 queries; with N = Tk + 1 columns only
    the pairs the future mask leaves open are defined (the others must be finite)."""
    from posenc_fairseq.encodings import positions

    monkeypatch.setattr(positions, "BLOCK_ELEMENTS", 1)  # chunks of 16 queries
    columns = columns or queries + keys - 1
    query = torch.randn(batch, 3, queries, 8, dtype=torch.float64, requires_grad=True)
    rel = torch.randn(3, columns, 8, dtype=torch.float64, requires_grad=True)
    column = queries - 1 - torch.arange(queries)[:, None] + torch.arange(keys)[None, :]
    defined = column < columns
    assert defined.all() or columns == keys + 1
    padded = torch.cat([rel, rel.new_zeros(3, queries + keys - 1 - columns, 8)], dim=1)
    expected = torch.einsum("bhid,hijd->bhij", query, padded[:, column])  # naive: every pair's row of rel
    got = positions.shifted_product(query, rel, keys)
    assert got.isfinite().all()
    assert torch.allclose(got[..., defined], expected[..., defined], rtol=0, atol=1e-12)
    weights = torch.randn_like(expected) * defined
    grads = torch.autograd.grad((got * weights).sum(), (query, rel))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, rel))
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12)


def test_shifted_product_computes_only_the_columns_a_chunk_reads(monkeypatch):
    """No product of every query with all Tq + Tk - 1 distances: each chunk of m queries meets
    m + Tk - 1 of them (under the future mask's N = Tk + 1 columns, fewer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from posenc_fairseq.encodings import positions

    monkeypatch.setattr(positions, "BLOCK_ELEMENTS", 1)  # chunks of 16 queries
    products = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith(("bmm", "mm", "matmul")):
                products.append(tuple(out.shape))
            return out

    query = torch.randn(1, 2, 64, 8)
    with Products():
        positions.shifted_product(query, torch.randn(2, 64 + 64 - 1, 8), 64)
    assert products and all(shape[-1] <= 16 + 64 - 1 for shape in products), products
    products.clear()
    with Products():
        positions.shifted_product(query, torch.randn(2, 64 + 1, 8), 64)
    # per head: chunks of 16 queries meet 17, 33, 49, 65 of the 65 distances (not 4 x 65)
    assert sum(shape[-2] * shape[-1] for shape in products) == 16 * (17 + 33 + 49 + 65), products


@pytest.mark.parametrize("queries,keys", [(7, 7), (5, 9), (9, 5), (1, 6), (12, 12)])
@pytest.mark.parametrize("bucket", ["clip2", "clip20", "floor3"])
def test_sum_by_distance_runs_equals_scatter_add_with_gradients(queries, keys, bucket):
    """Per query, the probabilities summed per row of each key's distance: against scatter_add
    with the (Tq, Tk) index of rows (Shaw's clip(j - i, k) and an LFHC-like floor(x / 3))."""
    from posenc_fairseq.encodings.positions import row_runs, sum_by_distance_runs

    def row_of(distance):  # distance = query - key
        if bucket == "floor3":
            return torch.div(distance, 3, rounding_mode="floor").clamp(-2, 2) + 2
        clip = int(bucket[4:])
        return (-distance).clamp(-clip, clip) + clip

    probs = torch.rand(2, 3, queries, keys, dtype=torch.float64, requires_grad=True)
    rows = row_of(torch.arange(queries)[:, None] - torch.arange(keys)[None, :])
    low, high = int(rows.min()), int(rows.max())
    expected = probs.new_zeros(2, 3, queries, high - low + 1).scatter_add(
        -1, (rows - low).expand(2, 3, queries, keys), probs)
    runs = row_runs((row_of(torch.arange(queries - 1, -keys, -1)) - low).tolist())  # distances high..low
    got = sum_by_distance_runs(probs, runs, high - low + 1)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    weights = torch.randn_like(expected)
    (grad,) = torch.autograd.grad((got * weights).sum(), probs)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), probs)
    assert torch.equal(grad, expected_grad)  # each probability's gradient is its row's weight


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 600), (torch.float16, 5000)])
def test_shifted_product_sums_half_precision_gradients_in_float32(dtype, batch):
    """rel's gradient is a sum over the batch items: a half-precision running sum of ones stops at
    256 (bf16) or 2048 (fp16); summed in float32 it is the count, rounded once."""
    from posenc_fairseq.encodings import positions

    query = torch.ones(batch, 1, 2, 1, dtype=dtype, requires_grad=True)
    rel = torch.ones(1, 3, 1, dtype=dtype, requires_grad=True)
    (grad,) = torch.autograd.grad(positions.shifted_product(query, rel, 2).sum(), rel)
    # pair (i, j) reads column 1 - i + j: (1, 0) column 0, (0, 0) and (1, 1) column 1, (0, 1) column 2
    assert grad.dtype == dtype and grad.view(-1).tolist() == [batch, 2 * batch, batch]
