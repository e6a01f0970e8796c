"""One form of a position term: values per key - query distance (`DistanceTerm`), and the shared
code that turns it into what each kernel reads.

Every encoding with relative terms gives them as a `DistanceTerm` (`distance_term`, and for a term
on the values `value_term`) for the distances low..high of a call; this module makes of it

    dense_logits    the (B or 1, H, Tq, Tk) logit term of consecutive positions (SDPA, explicit, logits, fused CPU)
    dense_values    the (B, H, Tq, D) value term from the probabilities (explicit)
    window          the term of a block of queries: a slice of the call's (query blocks, future mask)
    step_terms      one query's terms as additions to q, k, v and the logits (a decoding step)
    flex_table      the per-distance table FlexAttention reads inside its kernel
    bias_between    a bias-only term between arbitrary (not consecutive) positions (the plots)
"""
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .cache import TermKey
from .positions import (AnyPositions, Runs, bounds, per_distance, relative_shift, shifted_product,
                        sum_by_distance_runs, take_runs, tensor_of, toeplitz)



class DistanceTerm(NamedTuple):
    """An encoding's term for the key - query distances d = low..high of one call (column c = d - low,
    N = high - low + 1 columns, ascending), and for query i and key j at distance d with row r = the
    row of column d - low (`rows`; None: r = c):

        logits:  term(b, h, i, j) = bias[h, r] + (q_i + shift_h) . vectors[h, r] + content_h . k_j
        values:  z_i += sum_j p_ij vectors[h, r]            (`value_term`: `vectors` and `rows` only)

    bias (H, R) or None; vectors (H or 1, R, D) or None (1: shared by the heads); shift, content
    (H, 1, D) or None, scaled as the queries (which arrive scaled by 1/sqrt(D)); rows: `Runs` over
    the N columns, or None (R = N). `key`: names the values within a forward pass, so layers whose
    bias-only terms have the same key share their dense form (None: not shared).

    A decoding step writes the logit term as (q + content).(k_j + vectors) + bias + (shift -
    content).vectors; an encoding may give its step's term with `shift is content` (the same
    tensor) and that last term already in `bias` (XL), so a step computes nothing per distance."""
    low: int
    high: int
    bias: Optional[Tensor] = None
    vectors: Optional[Tensor] = None
    rows: Optional[Runs] = None
    shift: Optional[Tensor] = None
    content: Optional[Tensor] = None
    key: Optional[TermKey] = None


class StepTerms(NamedTuple):
    """One query's position terms (a decoding step) as additions to the attention's inputs, which
    then make plain (fused) attention:

        softmax_j((q + query) . (k_j + keys_j) + logits_j) . (v_j + values_j)

    `query` (H, 1, D); `keys`/`values` (H or 1, Tk, D); `logits` (H, 1, Tk); None: nothing there."""
    query: Optional[Tensor] = None
    keys: Optional[Tensor] = None
    values: Optional[Tensor] = None
    logits: Optional[Tensor] = None


class DistanceLogits(NamedTuple):
    """The logit term of one call as FlexAttention reads it (kernels/flex.py): for query i and key j of
    consecutive positions, c = j - i + Tq - 1 numbers the distances and the term of (b, h, i, j) is

        table[b, h, i, column[c]]  (+ key_bias[b, h, j])

    `table` (B or 1, H, Tq or 1, R): a size-1 batch or query dimension is shared; `column`
    (Tq + Tk - 1,) long, or None (column c itself); `key_bias` (B, H, Tk) or None."""
    table: Tensor
    column: Optional[Tensor] = None
    key_bias: Optional[Tensor] = None


def distance_range(query_positions: AnyPositions, key_positions: AnyPositions) -> Tuple[int, int]:
    """(lowest, highest) key - query distance of the pairs of 1-D positions (no device sync for
    `Positions`)."""
    (q_low, q_high), (k_low, k_high) = bounds(query_positions), bounds(key_positions)
    return k_low - q_high, k_high - q_low


# --- rows ------------------------------------------------------------------------------------------
def rows_window(rows: Runs, start: int, count: int) -> Tuple[Runs, int, int]:
    """The pieces of columns start..start+count-1 of `rows`, as rows counted from the lowest row
    they use, and (lowest, highest) row used."""
    pieces, skip = [], start
    for first, length, step in rows:
        if skip >= length:
            skip -= length
            continue
        first, length, skip = first + step * skip, length - skip, 0
        take = min(length, count - sum(piece[1] for piece in pieces))
        if take <= 0:
            break
        pieces.append((first, take, step))
    ends = [row for first, length, step in pieces for row in (first, first + step * (length - 1))]
    low, high = min(ends), max(ends)
    return tuple((first - low, length, step) for first, length, step in pieces), low, high


def column_rows(term: DistanceTerm, device) -> Optional[Tensor]:
    """(N,) long: the row of each column, or None where rows are the columns."""
    if term.rows is None:
        return None
    return torch.tensor([first + step * n for first, length, step in term.rows for n in range(length)],
                        dtype=torch.long, device=device)


def varying_columns(term: DistanceTerm) -> Tuple[int, int]:
    """(first, last): the columns between which `term`'s rows vary. Every column before `first` takes
    first's row and every column after `last` takes last's: the clipped ends of Shaw's and LFHC's
    rows. (0, N - 1) where the rows are the columns."""
    columns = term.high - term.low + 1
    if term.rows is None:
        return 0, columns - 1
    (_, head, head_step), (tail_row, tail, tail_step) = term.rows[0], term.rows[-1]
    first = head - 1 if head_step == 0 else 0
    last = columns - tail if tail_step == 0 else columns - 1
    if tail_step == 0 and len(term.rows) > 1:  # (`row_runs` may end the piece before on the same row)
        row, count, step = term.rows[-2]
        if row + step * (count - 1) == tail_row:
            last -= 1
    return first, max(first, last)


def window(term: DistanceTerm, low: int, high: int) -> DistanceTerm:
    """`term` for the distances low..high (within its own): a slice of its columns, with only the
    rows they use."""
    if (low, high) == (term.low, term.high):
        return term
    start, count = low - term.low, high - low + 1
    if term.rows is None:
        rows, first, last = None, start, start + count - 1
    else:
        rows, first, last = rows_window(term.rows, start, count)
    return term._replace(
        low=low, high=high, rows=rows,
        bias=term.bias[:, first: last + 1] if term.bias is not None else None,
        vectors=term.vectors[:, first: last + 1] if term.vectors is not None else None)


def for_heads(term: Optional[DistanceTerm], kept: Optional[Tensor]) -> Optional[DistanceTerm]:
    """`term` of the `kept` heads (head pruning) in their order."""
    if term is None or kept is None:
        return term

    def pick(x):
        return x[kept] if x is not None and x.size(0) > 1 else x
    # (key None: layers pruned differently must not share a dense form)
    return term._replace(bias=pick(term.bias), vectors=pick(term.vectors), shift=pick(term.shift),
                         content=pick(term.content), key=None)


def _scores(term: DistanceTerm, query: Tensor) -> Tensor:
    """(B, H, Tq, R): (q_i + shift) . vectors[r] of every row."""
    if term.shift is not None:
        query = query + term.shift
    if term.vectors.size(0) == 1:
        return query @ term.vectors[0].t()
    return per_distance(query, term.vectors)


# --- the forms ---------------------------------------------------------------------------------------
def dense_logits(term: DistanceTerm, query: Tensor, key: Tensor, future_blocked: bool = False,
                 content_folded: bool = False, memoize=None) -> Optional[Tensor]:
    """The term of consecutive positions, (B or 1, H, Tq, Tk) (a bias-only term: (H, Tq, Tk)), for
    `query` (B, H, Tq, D) and `key` (B, H, Tk, D). `future_blocked`: keys after their query are
    blocked (their entries may hold any finite value), so the query-dependent part is computed for
    the first Tk + 1 distances only; `content_folded`: the caller adds `content` to the queries
    of its product with the keys, so content.k_j is left out here (None: nothing else is left).
    `memoize(key, compute)`: shares a bias-only term's dense form across the layers of a forward
    (`term.key`)."""
    queries, keys = query.size(2), key.size(2)
    assert term.high - term.low + 1 == queries + keys - 1, (term.low, term.high, queries, keys)
    out = None
    if term.bias is not None:
        def spread():
            bias = term.bias if term.rows is None else take_runs(term.bias, term.rows)
            return toeplitz(bias, queries)
        if memoize is not None and term.key is not None and term.vectors is None and term.content is None:
            out = memoize(TermKey(term.key.role, term.key.encoding, "dense", (term.key, term.low, term.high, queries)),
                          spread)
        else:
            out = spread()
    if term.vectors is not None:
        part = term._replace(bias=None)
        if future_blocked and term.high - term.low + 1 > keys + 1:
            part = window(part, term.low, term.low + keys)  # distances up to +1: the rest is blocked
        if part.rows is None:
            query_shifted = query if part.shift is None else query + part.shift
            vectors = part.vectors if part.vectors.size(0) > 1 else part.vectors.expand(query.size(1), -1, -1)
            product = shifted_product(query_shifted, vectors, keys)
        else:
            product = relative_shift(take_runs(_scores(part, query), part.rows), keys)
        out = product if out is None else out + product
    if term.content is not None and not content_folded:
        content = (key @ term.content.transpose(-1, -2)).transpose(-1, -2)  # content.k_j, (B, H, 1, Tk)
        out = content if out is None else out + content
    return out


def dense_values(term: DistanceTerm, probs: Tensor) -> Tensor:
    """(B, H, Tq, D): sum_j p_ij vectors[row of j - i] for consecutive positions, from the
    probabilities (B, H, Tq, Tk): the probabilities summed per run of distances sharing a row,
    times the rows."""
    rows = term.rows if term.rows is not None else ((0, term.high - term.low + 1, 1),)
    per_row = sum_by_distance_runs(probs, list(rows), term.vectors.size(1))
    vectors = term.vectors[0] if term.vectors.size(0) == 1 else term.vectors
    return per_row @ vectors.to(probs.dtype)


def step_terms(term: Optional[DistanceTerm], values: Optional[DistanceTerm]) -> StepTerms:
    """One query against consecutive keys: its columns are the keys, in their order."""
    query = keys = logits = None
    if term is not None:
        logits = term.bias
        if logits is not None and term.rows is not None:
            logits = take_runs(logits, term.rows)  # (H, Tk): each key's row
        if term.vectors is not None:
            keys = vectors_per_column(term)
            if term.shift is not None and term.shift is not term.content:
                difference = term.shift if term.content is None else term.shift - term.content
                extra = (keys * difference).sum(-1)  # (H, Tk)
                logits = extra if logits is None else logits + extra
        logits = logits[:, None, :] if logits is not None else None
        query = term.content
    return StepTerms(query=query, keys=keys, values=vectors_per_column(values) if values is not None else None,
                     logits=logits)


def vectors_per_column(term: DistanceTerm) -> Tensor:
    """`vectors` of each column, (H or 1, N, D) (a decoding step's keys; the Triton kernel's table)."""
    if term.rows is None:
        return term.vectors
    return take_runs(term.vectors.transpose(-1, -2), term.rows).transpose(-1, -2)


def flex_table(term: DistanceTerm, query: Tensor, key: Tensor) -> DistanceLogits:
    """`term` as FlexAttention's table: the bias per row, and/or the query against every row."""
    table = None
    if term.vectors is not None:
        table = _scores(term, query)
    if term.bias is not None:
        bias = term.bias[None, :, None, :]
        table = bias if table is None else table + bias
    key_bias = None
    if term.content is not None:
        key_bias = (key @ term.content.transpose(-1, -2))[..., 0]  # (B, H, Tk)
    return DistanceLogits(table, column_rows(term, query.device), key_bias)


# --- arbitrary positions (the plots; the tests' reference terms: tests/position_terms.py) ---------------
def term_between(encoding, role, layer, queries, dtype, query_positions, key_positions, hook="distance_term"):
    """The encoding's `hook` term (`distance_term` or `value_term`) for the distances between 1-D
    positions."""
    low, high = distance_range(query_positions, key_positions)
    return getattr(encoding, hook)(role, layer, low, high, queries, dtype)


def pair_distances(query_positions: AnyPositions, key_positions: AnyPositions) -> Tensor:
    """(Tq, Tk) key - query distance of each pair of 1-D positions."""
    return tensor_of(key_positions).long()[None, :] - tensor_of(query_positions).long()[:, None]


def rows_of(term: DistanceTerm, distances: Tensor) -> Tensor:
    """The row of each key - query distance in `distances` (any shape, within low..high)."""
    column = distances - term.low
    rows = column_rows(term, column.device)
    return column if rows is None else rows[column]


def bias_between(encoding, role: str, layer: int, query_positions: AnyPositions, key_positions: AnyPositions,
                 dtype: torch.dtype) -> Optional[Tensor]:
    """(H, Tq, Tk): the encoding's logit term between 1-D positions where it is a bias alone (T5,
    AT5, ALiBi); None where the layer has no term or one that depends on the tokens."""
    term = term_between(encoding, role, layer, len(tensor_of(query_positions)), dtype, query_positions, key_positions)
    if term is None or term.vectors is not None or term.content is not None:
        return None
    return term.bias[:, rows_of(term, pair_distances(query_positions, key_positions))]
