"""An encoding's position terms between 1-D positions, consecutive or not: the reference the tests
hold the attention's terms to. (The package computes terms only for the consecutive positions of an
attention call, from Python integers; `distance.bias_between` serves the plots.)"""
from typing import Optional

import torch
from torch import Tensor

from posenc_fairseq.encodings.distance import (_scores, dense_logits, dense_values, pair_distances, rows_of,
                                               term_between)
from posenc_fairseq.encodings.positions import AnyPositions, Positions, tensor_of


def position_range(start: int, stop: int, device=None) -> Positions:
    """Positions start..stop-1 of torch.arange(start, stop)."""
    return Positions(start, stop, device=device)


def is_range(positions: AnyPositions) -> bool:
    """Whether `positions` is a `position_range` (1-D, consecutive, ascending)."""
    return isinstance(positions, Positions) and positions.tensor.dim() == 1


def logits_between(encoding, role: str, layer: int, query: Optional[Tensor], key: Optional[Tensor],
                   query_positions: AnyPositions, key_positions: AnyPositions,
                   dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """The encoding's logit term between 1-D positions, any (consecutive or not): (B or 1, H, Tq,
    Tk), a bias-only term (H, Tq, Tk); None where the layer has none. `query` (B, H, Tq, D) scaled by
    1/sqrt(D) and `key` (B, H, Tk, D); a term that reads neither may be asked with None for both."""
    queries = len(tensor_of(query_positions))
    dtype = dtype or (query.dtype if query is not None else torch.get_default_dtype())
    term = term_between(encoding, role, layer, queries, dtype, query_positions, key_positions)
    if term is None:
        return None
    if query is not None and is_range(query_positions) and is_range(key_positions):
        return dense_logits(term, query, key, memoize=encoding.memoize)
    index = rows_of(term, pair_distances(query_positions, key_positions))
    out = None
    if term.bias is not None:
        out = term.bias[:, index]
    if term.vectors is not None:
        scores = _scores(term, query)
        batch, heads, tq, _ = scores.shape
        part = scores.gather(-1, index.expand(batch, heads, tq, index.size(-1)))
        out = part if out is None else out + part
    if term.content is not None:
        content = (key @ term.content.transpose(-1, -2)).transpose(-1, -2)
        out = content if out is None else out + content
    return out


def values_between(encoding, role: str, layer: int, probs: Tensor, query_positions: AnyPositions,
                   key_positions: AnyPositions) -> Optional[Tensor]:
    """The encoding's value term between 1-D positions, any: (B, H, Tq, D) from the probabilities
    (B, H, Tq, Tk); None where the layer has none."""
    term = term_between(encoding, role, layer, probs.size(2), probs.dtype, query_positions, key_positions, "value_term")
    if term is None:
        return None
    if is_range(query_positions) and is_range(key_positions):
        return dense_values(term, probs)
    index = rows_of(term, pair_distances(query_positions, key_positions))
    batch, heads, tq, tk = probs.shape
    per_row = probs.new_zeros(batch, heads, tq, term.vectors.size(1))
    per_row = per_row.scatter_add(-1, index.expand(batch, heads, tq, tk), probs)
    vectors = term.vectors[0] if term.vectors.size(0) == 1 else term.vectors
    return per_row @ vectors.to(probs.dtype)
