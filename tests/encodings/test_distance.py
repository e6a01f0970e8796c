"""distance.py: every form made of a `DistanceTerm` against the term's definition written as loops,

    term(b, h, i, j) = bias[h, r] + (q_i + shift_h) . vectors[h, r] + content_h . k_j,   r = row of j - i - low

for the three kinds of terms the encodings give (a bias per distance; table rows shared by the
heads with runs of rows; per-head vectors with shift and content)."""
import random

import pytest
import torch

from posenc_fairseq.encodings.distance import (DistanceTerm, dense_logits, dense_values, flex_table, rows_window,
                                               step_terms, varying_columns, window)
from posenc_fairseq.encodings.positions import row_runs, take_runs
from position_terms import position_range, values_between

B, H, D = 2, 3, 4
KINDS = ["bias", "rows", "vectors", "everything"]


def make_term(kind, low, high, generator):
    n = high - low + 1

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)
    if kind == "bias":
        return DistanceTerm(low, high, bias=randn(H, n))
    if kind in ("rows", "everything"):  # Shaw-like: clipped at +-2 around 0
        rows = [min(max(d, -2), 2) + 2 for d in range(low, high + 1)]
        first, last = min(rows), max(rows)
        runs = tuple(row_runs([row - first for row in rows]))
        if kind == "rows":
            return DistanceTerm(low, high, vectors=randn(1, last - first + 1, D), rows=runs)
        # every field at once: a bias and per-head vectors per row, shift and content
        count = last - first + 1
        return DistanceTerm(low, high, bias=randn(H, count), vectors=randn(H, count, D), rows=runs,
                            shift=randn(H, 1, D), content=randn(H, 1, D))
    return DistanceTerm(low, high, vectors=randn(H, n, D), shift=randn(H, 1, D), content=randn(H, 1, D))


def row_list(term):
    if term.rows is None:
        return list(range(term.high - term.low + 1))
    return [first + step * n for first, length, step in term.rows for n in range(length)]


def naive(term, query, key, query_positions, key_positions):
    """The definition, pair by pair."""
    rows = row_list(term)
    out = torch.zeros(query.size(0), H, len(query_positions), len(key_positions), dtype=torch.float64)
    for b in range(query.size(0)):
        for h in range(H):
            for i, qp in enumerate(query_positions):
                for j, kp in enumerate(key_positions):
                    r = rows[kp - qp - term.low]
                    value = 0.0
                    if term.bias is not None:
                        value += term.bias[h, r]
                    if term.vectors is not None:
                        shifted = query[b, h, i] + (term.shift[h, 0] if term.shift is not None else 0)
                        value += shifted @ term.vectors[h if term.vectors.size(0) > 1 else 0, r]
                    if term.content is not None:
                        value += term.content[h, 0] @ key[b, h, j]
                    out[b, h, i, j] = value
    return out


def call(kind, queries, keys, seed=0):
    """A call whose queries are the last `queries` of `keys` consecutive positions."""
    generator = torch.Generator().manual_seed(seed)
    term = make_term(kind, 1 - keys, queries - 1, generator)
    query = torch.randn(B, H, queries, D, generator=generator, dtype=torch.float64)
    key = torch.randn(B, H, keys, D, generator=generator, dtype=torch.float64)
    return term, query, key, list(range(keys - queries, keys)), list(range(keys))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("queries,keys", [(5, 5), (3, 7), (1, 6)])
def test_dense_logits_is_the_definition(kind, queries, keys):
    term, query, key, q_pos, k_pos = call(kind, queries, keys)
    expected = naive(term, query, key, q_pos, k_pos)
    assert torch.allclose(dense_logits(term, query, key).expand_as(expected), expected, atol=1e-12)
    if term.content is not None:  # folded: the caller adds content . k_j
        folded = dense_logits(term, query, key, content_folded=True)
        content = (key @ term.content.transpose(-1, -2)).transpose(-1, -2)
        assert torch.allclose(folded + content, expected, atol=1e-12)


@pytest.mark.parametrize("kind", ["rows", "vectors", "everything"])
def test_future_blocked_keeps_every_pair_it_does_not_block(kind):
    term, query, key, q_pos, k_pos = call(kind, 6, 6)
    expected = naive(term, query, key, q_pos, k_pos)
    got = dense_logits(term, query, key, future_blocked=True)
    seen = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.allclose(got[..., seen], expected[..., seen], atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_is_the_block_of_the_whole_call(kind):
    """Queries 2..4 of 7 against keys 0..5 (a block under the future mask): the window of the
    call's term gives the block's part of the whole call's logits."""
    term, query, key, q_pos, k_pos = call(kind, 7, 7)
    whole = dense_logits(term, query, key)
    block = window(term, 0 - 4, 5 - 2)
    got = dense_logits(block, query[:, :, 2:5], key[:, :, :6])
    assert torch.allclose(got.expand(B, H, 3, 6), whole.expand(B, H, 7, 7)[:, :, 2:5, :6], atol=1e-12)
    if term.rows is not None:  # only the rows the window uses
        assert block.vectors.size(1) == max(row_list(block)) + 1 and min(row_list(block)) == 0


def test_rows_window_takes_the_columns_it_is_asked():
    generator = random.Random(1)
    values = torch.randn(2, 9)
    for _ in range(300):
        rows = [generator.randrange(9) for _ in range(generator.randint(1, 15))]
        start = generator.randrange(len(rows))
        count = generator.randint(1, len(rows) - start)
        pieces, low, high = rows_window(tuple(row_runs(rows)), start, count)
        chosen = rows[start: start + count]
        assert (low, high) == (min(chosen), max(chosen))
        assert torch.equal(take_runs(values[:, low: high + 1], pieces), values[:, chosen]), rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("step_form", [False, True])
def test_a_step_is_plain_attention_of_the_changed_inputs(kind, step_form):
    """One query: (q + query) . (k_j + keys_j) + logits_j - q . k_j is the term of every key; with
    `step_form` the term is given as XL gives a decoding step's (shift is content, the rest in bias)."""
    term, query, key, q_pos, k_pos = call(kind, 1, 6)
    expected = naive(term, query, key, q_pos, k_pos)
    if step_form and term.shift is not None:
        extra = (term.vectors * (term.shift - term.content)).sum(-1)  # (H, R)
        term = term._replace(bias=extra if term.bias is None else term.bias + extra, shift=term.content)
    terms = step_terms(term, None)
    q = query + (terms.query if terms.query is not None else 0)
    k = key + (terms.keys if terms.keys is not None else 0)
    got = q @ k.transpose(-1, -2) + (terms.logits if terms.logits is not None else 0) - query @ key.transpose(-1, -2)
    assert torch.allclose(got, expected, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_flex_table_is_the_definition(kind):
    term, query, key, q_pos, k_pos = call(kind, 4, 6)
    expected = naive(term, query, key, q_pos, k_pos)
    table, column, key_bias = flex_table(term, query, key)
    i, j = torch.arange(4)[:, None], torch.arange(6)[None, :]
    c = j - i + 3
    c = column[c] if column is not None else c
    got = table.expand(B, H, 4, table.size(-1)).gather(-1, c.expand(B, H, -1, -1))
    if key_bias is not None:
        got = got + key_bias[:, :, None, :]
    assert torch.allclose(got, expected, atol=1e-12)


class TableEncoding:
    """An encoding whose value term is a fixed `DistanceTerm` over distances -6..6."""

    def __init__(self, term):
        self.term = term

    def value_term(self, role, layer, low, high, queries, dtype):
        return window(self.term, low, high)


def test_values_of_arbitrary_and_consecutive_positions_are_the_definition():
    generator = torch.Generator().manual_seed(3)
    term = make_term("rows", -6, 6, generator)
    encoding = TableEncoding(term)
    rows = row_list(term)

    def naive_values(probs, q_pos, k_pos):
        out = torch.zeros(B, H, len(q_pos), D, dtype=torch.float64)
        for i, qp in enumerate(q_pos):
            for j, kp in enumerate(k_pos):
                out[:, :, i] += probs[:, :, i, j, None] * term.vectors[0, rows[kp - qp + 6]]
        return out
    probs = torch.rand(B, H, 4, 5, generator=generator, dtype=torch.float64)
    arbitrary = values_between(encoding, "encoder", 0, probs, torch.tensor([0, 3, 1, 4]), torch.tensor([2, 0, 4, 1, 3]))
    assert torch.allclose(arbitrary, naive_values(probs, [0, 3, 1, 4], [2, 0, 4, 1, 3]), atol=1e-12)
    consecutive = values_between(encoding, "encoder", 0, probs, position_range(1, 5), position_range(0, 5))
    assert torch.allclose(consecutive, naive_values(probs, [1, 2, 3, 4], [0, 1, 2, 3, 4]), atol=1e-12)
    assert torch.allclose(dense_values(window(term, -4, 3), probs), consecutive, atol=1e-12)


def test_varying_columns_bound_the_columns_whose_rows_differ():
    """Shaw's clipped rows: the columns of each end take one row, from the first and last of the
    clipped distance (what the Triton kernel's tiles at the tables' ends rely on); random rows: every
    column before `first` has first's row and every column after `last` last's, and neither could be
    moved further; rows per column: every column varies."""
    rows = [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 6, 6]  # clip(j - i, 3) + 3 over the distances -6..5
    term = DistanceTerm(-6, 5, vectors=torch.zeros(1, 7, 4), rows=tuple(row_runs(rows)))
    assert varying_columns(term) == (3, 9)
    assert varying_columns(DistanceTerm(-6, 5, vectors=torch.zeros(1, 12, 4))) == (0, 11)
    assert varying_columns(DistanceTerm(0, 4, bias=torch.zeros(1, 1), rows=tuple(row_runs([0] * 5)))) == (4, 4)
    generator = random.Random(0)
    for _ in range(200):
        rows = [generator.choice([0, 0, 1, 2]) for _ in range(generator.randint(1, 12))]
        term = DistanceTerm(0, len(rows) - 1, bias=torch.zeros(1, 3), rows=tuple(row_runs(rows)))
        first, last = varying_columns(term)
        assert 0 <= first <= last < len(rows)
        assert all(row == rows[first] for row in rows[:first]) and all(row == rows[last] for row in rows[last:])
        assert rows[first + 1] != rows[first] if first + 1 < len(rows) else True
