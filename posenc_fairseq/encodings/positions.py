"""Positions whose bounds are known on the host, and the arithmetic of values per key - query distance.

The stacks announce their unpadded tokens, and a decoding step its one position, as `Positions`
whose tensor is (B, T) with every row alike (`shared_range`). An encoding reads their bounds with
`bounds`, which then costs no device synchronisation (on CUDA `int(tensor)` waits for the device,
once per layer and decoding step). The facts travel in the value, not on a tensor: a plain tensor
is arbitrary positions, whose bounds `bounds` reads from the tensor (a device synchronisation) and
for which the encodings take their general paths.

The per-distance arithmetic serves the attention's calls, whose queries i = 0..Tq-1 and keys
j = 0..Tk-1 have consecutive positions: a per-distance tensor holds the key - query distances
low..high in ascending order (low = first key - last query, high = last key - first query), and
pair (i, j), at distance d = low + c, reads its column c = j - i + Tq - 1 (design.md's c = d - low).
`relative_shift` reads such a tensor as (Tq, Tk) pairs, `shifted_product` and `toeplitz` spread
values per distance over the pairs, `sum_by_distance_runs` sums the pairs per distance, and
`row_runs` / `take_runs` handle table rows shared by runs of distances (Shaw, LFHC).
"""
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..block_size import BLOCK_ELEMENTS, rows_per_block


#: pieces (first row, count, step) of `row_runs`: the row of each column
Runs = Sequence[Tuple[int, int, int]]


@dataclass(frozen=True, slots=True)
class Positions:
    """The consecutive positions start..stop-1, known on the host, and their `tensor`: (rows, stop -
    start) with every row alike (`shared_range`), or 1-D where `rows` is None (the tests'
    `position_range`). The tensor is made on first use: most readers need the bounds alone, and a
    decoding step would otherwise pay two tensor operations (on CUDA a kernel launch) for nothing."""
    start: int
    stop: int
    rows: Optional[int] = field(default=None, compare=False)
    device: Optional[torch.device] = field(default=None, compare=False, repr=False)
    made: List[Tensor] = field(default_factory=list, init=False, compare=False, repr=False)  # the tensor, once made

    def __len__(self) -> int:
        """Positions per row (a 1-D range: its length)."""
        return self.stop - self.start

    @property
    def tensor(self) -> Tensor:
        """(rows, stop - start), a read-only view of one row, or 1-D: a function of the fields alone."""
        if not self.made:
            values = torch.arange(self.start, self.stop, device=self.device)
            self.made.append(values if self.rows is None else values.expand(self.rows, self.stop - self.start))
        return self.made[0]


@dataclass(frozen=True, slots=True, eq=False)  # (equal only to itself: its tensor has no one truth value)
class PaddedPositions:
    """The (B, T) `tensor` of a padded batch's token positions, each real token's count of real
    tokens before it in its row (pads 0: `token_positions`), and one more than the largest, `stop`
    (at least 1), known on the host: the stack read it with its padding check (one host read for
    both), so an encoding that needs the bound (FLOATER's table rows) reads nothing more."""
    tensor: Tensor
    stop: int


#: what the hooks take as positions: `Positions`, `PaddedPositions`, or a tensor of arbitrary positions
AnyPositions = Union[Positions, PaddedPositions, Tensor]


def shared_range(batch: int, start: int, stop: int, device=None) -> Positions:
    """(batch, stop - start) token positions, every row start..stop-1 (a stack's tokens without
    padding, or one decoding step): an encoding may compute the values of one row and share them
    across the batch (`is_shared_range`)."""
    return Positions(start, stop, batch, device)


def tensor_of(positions: AnyPositions) -> Tensor:
    """The tensor of `positions` (`Positions`, `PaddedPositions` or a tensor)."""
    return positions.tensor if isinstance(positions, (Positions, PaddedPositions)) else positions


def is_shared_range(positions: Optional[AnyPositions]) -> bool:
    """Whether `positions` is a `shared_range` (every row the same consecutive positions)."""
    return isinstance(positions, Positions) and positions.rows is not None


def bounds(positions: AnyPositions) -> Tuple[int, int]:
    """(min, max) of `positions`: known for `Positions`, and for `PaddedPositions` (whose pads are 0)
    unless empty; read from a tensor of arbitrary positions (a device synchronisation)."""
    if isinstance(positions, Positions):
        return positions.start, positions.stop - 1
    if isinstance(positions, PaddedPositions) and positions.tensor.numel() > 0:
        return 0, positions.stop - 1
    positions = tensor_of(positions)
    return int(positions.min()), int(positions.max())


def relative_shift(per_distance: Tensor, keys: int) -> Tensor:
    """(B, H, Tq, Tk) view of `per_distance` (B, H, Tq, N), whose column c holds the value of key -
    query distance low + c (ascending; low = first key - last query), for consecutive query and key
    positions: pair (i, j) reads column c = j - i + Tq - 1, so the result is a strided view at flat
    offset i * (N - 1) + j + Tq - 1 = i * N + c of each (B, H) slab (rows of Tk that do not
    overlap). No (Tq, Tk) index tensor, and unlike gather the view keeps nothing for the backward
    pass (gather keeps its whole (B, H, Tq, N) input).

    N = Tq + Tk - 1 covers every distance. Under a future mask (the queries the last Tq of the
    keys, each key after its query blocked) N = Tk + 1 columns, distances low..1, are enough: a
    blocked pair past them (j - i > N - Tq) reads a column of the next row, a finite value the mask
    replaces."""
    per_distance = per_distance.contiguous()
    batch, heads, queries, n = per_distance.shape
    assert n == queries + keys - 1 or keys < n < queries + keys - 1, (per_distance.shape, keys)
    return per_distance.as_strided((batch, heads, queries, keys), (heads * queries * n, queries * n, n - 1, 1),
                                   per_distance.storage_offset() + queries - 1)


def per_distance(query: Tensor, vectors: Tensor) -> Tensor:
    """(B, H, Tq, N) query_i . r_c of `query` (B, H, Tq, D) and `vectors` (H, N, D), one vector r_c per
    distance c."""
    if query.size(0) == 1:  # (bmm keeps vectors as the view it is; matmul's broadcast copies it per call)
        return torch.bmm(query[0], vectors.transpose(-1, -2))[None]
    return query @ vectors.transpose(-1, -2)[None]


def _shift_chunks(query: Tensor, n: int, keys: int):
    """Chunks of `shifted_product`'s queries: (rows, first column, last column + 1, width). A chunk
    of m queries r0..r1-1 reads the columns c = j - i + Tq - 1 of its pairs,
    Tq - r1 .. Tq - 1 - r0 + Tk - 1 of `vectors` (its distances, ascending: m + Tk - 1 of them, fewer
    where N stops first); `width` = m + Tk - 1 lays them out for `relative_shift`."""
    batch, heads, queries = query.shape[:3]
    step = rows_per_block(BLOCK_ELEMENTS, batch * heads * (n + keys), 16)
    for start in range(0, queries, step):
        stop = min(start + step, queries)
        low = queries - stop
        yield slice(start, stop), low, max(low, min(n, queries - 1 - start + keys)), stop - start + keys - 1


class _ShiftedProduct(torch.autograd.Function):
    """See `shifted_product`."""

    @staticmethod
    def forward(ctx, query: Tensor, vectors: Tensor, keys: int) -> Tensor:
        batch, heads, queries, _ = query.shape
        out = query.new_empty(batch, heads, queries, keys)
        for rows, low, high, width in _shift_chunks(query, vectors.size(1), keys):
            chunk = per_distance(query[:, :, rows], vectors[:, low:high])  # (B, H, m, high - low)
            if high - low < width:  # columns past N (pairs the future mask blocks): zeros
                chunk = torch.nn.functional.pad(chunk, (0, width - (high - low)))
            out[:, :, rows] = relative_shift(chunk, keys)
        ctx.save_for_backward(query, vectors)
        ctx.keys = keys
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        query, vectors = ctx.saved_tensors
        keys = ctx.keys
        grad_query = torch.empty_like(query) if ctx.needs_input_grad[0] else None
        # the vectors' gradient is a sum over the chunks and the batch: in float32 for fp16/bf16 (a
        # half-precision running sum stops growing once it is 2^8 (bf16) or 2^11 times a term)
        accumulate = torch.promote_types(vectors.dtype, torch.float32)
        grad_vectors = vectors.new_zeros(vectors.shape, dtype=accumulate) if ctx.needs_input_grad[1] else None
        buffer = None  # one chunk's gradient per distance, reused by the chunks of its size
        for rows, low, high, width in _shift_chunks(query, vectors.size(1), keys):
            count = rows.stop - rows.start
            if buffer is None or buffer.shape[2:] != (count, width):
                buffer = grad.new_empty(grad.size(0), grad.size(1), count, width)
            buffer.zero_()
            relative_shift(buffer, keys).copy_(grad[:, :, rows])  # each pair's gradient at its distance
            grad_distance = buffer[..., : high - low]
            if grad_query is not None:
                grad_query[:, :, rows] = grad_distance @ vectors[:, low:high][None]
            if grad_vectors is not None:
                # (summed over the batch without a copy; in half precision, one copy per chunk in float32)
                grad_distance, rows_query = grad_distance.to(accumulate), query[:, :, rows].to(accumulate)
                for batch in range(query.size(0)):
                    grad_vectors[:, low:high].baddbmm_(grad_distance[batch].transpose(-1, -2), rows_query[batch])
        return grad_query, grad_vectors.to(vectors.dtype) if grad_vectors is not None else None, None


def shifted_product(query: Tensor, vectors: Tensor, keys: int) -> Tensor:
    """`relative_shift(per_distance(query, vectors), keys)`: (B, H, Tq, Tk) query_i . r_c(i, j),
    c(i, j) = j - i + Tq - 1 (`vectors` over the key - query distances in ascending order: each pair's
    distance), computed a chunk of queries at a time against only the columns the chunk reads. No
    (B, H, Tq, N) product exists (at long lengths allocating it costs more than computing it:
    docs/benchmarks.md), and the columns no row of a chunk reads are not computed. Where
    N < Tq + Tk - 1 (under the future mask N = Tk + 1) a pair past column N - 1 reads zero, a finite
    value the mask replaces."""
    assert vectors.size(1) == query.size(2) + keys - 1 or keys < vectors.size(1) < query.size(2) + keys - 1, \
        (query.shape, vectors.shape, keys)
    return _ShiftedProduct.apply(query, vectors, keys)


class _Toeplitz(torch.autograd.Function):
    """See `toeplitz`. Backward: the gradient's diagonals summed through `relative_shift`'s strided
    layout (a zero buffer, one strided copy, one sum); index_put's accumulation, the backward of an
    index, is slower on CPU (docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, values: Tensor, queries: int) -> Tensor:
        keys = values.size(-1) - queries + 1
        return values.unfold(-1, keys, 1).flip(-2)  # row r = values[r: r + Tk]; rows reversed (a copy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        queries, keys = grad.shape[-2:]
        n = queries + keys - 1
        flat = grad.reshape(1, -1, queries, keys)
        skewed = flat.new_zeros(1, flat.size(1), queries, n)  # column c: the pairs with j - i = c - (Tq - 1)
        relative_shift(skewed, keys).copy_(flat)
        return skewed.sum(2).view(*grad.shape[:-2], n), None


def toeplitz(values: Tensor, queries: int) -> Tensor:
    """(..., Tq, Tk) with [..., i, j] = values[..., j - i + Tq - 1], from `values` (..., Tq + Tk - 1)
    over the key - query distances of consecutive positions in ascending order: a bias per distance
    (T5, AT5) spread over the pairs, as values[..., distance index] would, with a cheaper backward."""
    return _Toeplitz.apply(values, queries)


class _SumRuns(torch.autograd.Function):
    """See `sum_by_distance_runs`."""

    @staticmethod
    def forward(ctx, probs: Tensor, runs: Runs, rows: int) -> Tensor:
        batch, heads, queries, keys = probs.shape
        skewed = probs.new_zeros(batch, heads, queries, queries + keys - 1)  # column c: distance low + c
        relative_shift(skewed, keys).copy_(probs)
        out = probs.new_zeros(batch, heads, queries, rows)
        column = 0
        for first, count, step in runs:
            piece = skewed[..., column: column + count]
            if step == 0:
                out[..., first] += piece.sum(-1)
            elif step == 1:
                out[..., first: first + count] += piece
            else:
                out[..., first - count + 1: first + 1] += piece.flip(-1)
            column += count
        ctx.runs, ctx.keys = runs, keys
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        return relative_shift(take_runs(grad, ctx.runs), ctx.keys).contiguous(), None, None


def sum_by_distance_runs(probs: Tensor, runs: Runs, rows: int) -> Tensor:
    """(B, H, Tq, rows): for each query, the sum of its `probs` (B, H, Tq, Tk) over the keys whose
    distance falls in each row, for consecutive positions and `runs` (`row_runs`) giving the row of
    each key - query distance low..high (the columns `relative_shift` reads): what scatter_add with
    a (Tq, Tk) index computes, without the index. The pairs are laid out by distance
    (`relative_shift`), each run of distances is one slice (a clipped end: one sum), and the
    backward is `take_runs` of the gradient read back through the same layout."""
    return _SumRuns.apply(probs, runs, rows)


def row_runs(rows: List[int]) -> Runs:
    """`rows` (a Python list of table rows, one per column) as pieces (first, count, step): step
    +1 or -1 is a slice of `count` consecutive rows from `first`, step 0 is row `first` repeated
    `count` times. Clipped relative buckets (Shaw, LFHC) give few pieces: the two clipped ends and
    the band between them."""
    pieces: List[List[int]] = []
    for row in rows:
        if pieces:
            first, count, step = pieces[-1]
            direction = row - (first + step * (count - 1))  # from the piece's last row
            if count == 1 and abs(direction) <= 1 or count > 1 and direction == step:
                pieces[-1] = [first, count + 1, direction]
                continue
        pieces.append([row, 1, 0])
    return [tuple(piece) for piece in pieces]


def take_runs(values: Tensor, runs: Runs) -> Tensor:
    """values[..., rows] for the rows that `row_runs` describes: slices and expanded single rows
    joined by one cat, i.e. no index tensor, and a backward pass of copies and sums (index_select
    along the last dimension, and its index_add backward, cost more on CPU: docs/benchmarks.md)."""
    shape = values.shape[:-1]
    pieces = []
    for first, count, step in runs:
        if step == 0:
            pieces.append(values[..., first: first + 1].expand(*shape, count))
        elif step == 1:
            pieces.append(values[..., first: first + count])
        else:
            pieces.append(values[..., first - count + 1: first + 1].flip(-1))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
