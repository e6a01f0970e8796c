"""The dense form of what is added to the scaled logits: the encoding's position term
(`distance.dense_logits`) and the masks, as one tensor that broadcasts against
(B, H, Tq, Tk). The kernels that read the terms in another form (FLEX, STEP) do not build it."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..encodings.distance import dense_logits
from .masks import blocked_fill_value, only_blocks


def all_heads(x: Tensor, dim: int, kept: Tensor, heads: int) -> Tensor:
    """After head pruning: `x` with the `kept` heads along `dim` put back among zeros for the
    pruned ones, `heads` in all, in the original head order the encoding's per-head terms are
    indexed by."""
    shape = list(x.shape)
    shape[dim] = heads
    return x.new_zeros(shape).index_copy(dim, kept, x)


def position_terms(call, content_folded: bool) -> Optional[Tensor]:
    """The encoding's logit term of the `AttentionCall` `call` in the dense form, (B or 1, H, Tq, Tk),
    zero on the --cross-self-attention source keys; None: none. `content_folded`: the caller adds
    the term's content vector to the queries of its product with the keys."""
    if call.term is None:
        return None
    term = dense_logits(call.term, call.q, call.k_target, call.future_blocked, content_folded,
                        memoize=call.encoding.memoize).to(call.q.dtype)
    return F.pad(term, (call.source_keys, 0)) if call.source_keys else term


def with_masks(call, additive: Optional[Tensor]) -> Optional[Tensor]:
    """`additive` (or nothing) plus the attention mask's finite part, with the blocked entries (mask
    and padding) at the dtype's finite minimum; (B or 1, H or 1, Tq, Tk). None: nothing to add."""
    attn_mask, key_padding_mask, dtype = call.attn_mask, call.key_padding_mask, call.q.dtype
    blocked = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            blocked = attn_mask
        else:
            blocked = torch.isneginf(attn_mask)
            if not only_blocks(attn_mask):  # (fairseq's future mask: no full-size addition of zeros)
                finite = attn_mask.masked_fill(blocked, 0).to(dtype)
                additive = finite if additive is None else additive + finite
    if key_padding_mask is not None:
        padding = key_padding_mask.to(torch.bool).view(key_padding_mask.size(0), 1, 1, -1)
        blocked = padding if blocked is None else (blocked | padding)
    if blocked is not None:
        if additive is None:
            additive = torch.zeros((), dtype=dtype, device=call.q.device)
        additive = additive.masked_fill(blocked, blocked_fill_value(dtype))
    return additive
