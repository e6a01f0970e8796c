"""The explicit softmax: logits, probabilities and output written out in full. Serves the calls that
need the probabilities (attention weights asked for, a relative value term mixed from them), the
logits before softmax (fairseq's `before_softmax`), and terms with a gradient that no fused
kernel serves well."""
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .subnormals import flush_subnormals_in_backward
from .terms import masked_logits
from ..encodings.distance import dense_values


def products(q: Tensor, k: Tensor) -> Tensor:
    """q k^T, (B, H, Tq, Tk); in half precision computed and returned in float32 (autocast off), as the
    fused kernels keep their logits: a product past fp16's 65504 (FLOATER's biases far beyond the
    training lengths; `floater/table.bias_limit` counts on it) would be inf, then NaN."""
    if q.dtype in (torch.float16, torch.bfloat16):
        with torch.autocast(q.device.type, enabled=False):
            return q.float() @ k.float().transpose(-1, -2)
    return q @ k.transpose(-1, -2)


def logits(q: Tensor, k: Tensor, terms: Optional[Tensor]) -> Tensor:
    """q k^T (+ terms), (B, H, Tq, Tk); `q` already scaled; float32 for half-precision inputs (`products`)."""
    scores = products(q, k)
    return scores if terms is None else scores + terms


def softmax(scores: Tensor) -> Tensor:
    """softmax over the keys, in float32 for half precision and in the scores' own dtype otherwise
    (float64's blocked fill, its finite minimum, would become -inf in float32: NaN for a row that
    sees no key)."""
    if scores.dtype in (torch.float32, torch.float64):
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.to(torch.float32), dim=-1).type_as(scores)


def attend(call, q: Tensor, terms: Optional[Tensor], dropout: Callable[[Tensor], Tensor]) -> Tuple[Tensor, Tensor]:
    """softmax(q k^T + terms) v of the `AttentionCall` `call` (its queries as `q`: with the content
    query where folded), the keys its masks block left out, plus its relative value term; the
    output (B, H, Tq, D) and the probabilities (B, H, Tq, Tk). `terms`: without the blocked
    entries (`terms.with_finite_mask`); `dropout`: the attention's dropout module. The logits of
    half-precision inputs are float32 (`products`)."""
    scores = products(q, call.k)
    probs = softmax(masked_logits(call, scores if terms is None else scores + terms)).to(q.dtype)
    dropped = dropout(probs) if call.dropout_p > 0 else probs
    out = dropped @ call.v
    if call.values is not None:
        target_probs = dropped[..., call.source_keys:] if call.source_keys else dropped
        out = out + dense_values(call.values, target_probs).to(out.dtype)
    if call.term is not None and terms is not None:
        flush_subnormals_in_backward(out, scores)
    return out, probs
