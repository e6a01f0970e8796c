"""The dense form of what is added to the scaled logits: the encoding's position terms
(`logit_bias`, `relative_logits`) and the masks, as one tensor that broadcasts against
(B, H, Tq, Tk). The kernels that read the terms in another form (FLEX, STEP) do not build it."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import blocked_fill_value, only_blocks


def all_heads(x: Tensor, dim: int, kept: Tensor, heads: int) -> Tensor:
    """After head pruning: `x` with the `kept` heads along `dim` put back among zeros for the
    pruned ones, `heads` in all, in the original head order the encoding's per-head terms are
    indexed by."""
    shape = list(x.shape)
    shape[dim] = heads
    return x.new_zeros(shape).index_copy(dim, kept, x)


def position_terms(call, content_folded: bool) -> Optional[Tensor]:
    """The encoding's logit terms of the `AttentionCall` `call`, (B or 1, H, Tq, Tk), zero on the
    --cross-self-attention source keys; None: none. `content_folded`: the caller adds the
    encoding's `content_query` to the queries of its product with the keys (the encoding leaves
    that term out)."""
    if not call.relative:
        return None
    encoding, role, layer, kept = call.encoding, call.role, call.layer, call.kept_heads
    q, q_pos, k_pos = call.q, call.query_positions, call.key_positions
    bias = encoding.logit_bias(role, layer, q_pos, k_pos)
    if bias is not None and kept is not None:
        bias = bias[kept]
    if kept is None:
        rel = encoding.relative_logits(role, layer, q, call.k_target, q_pos, k_pos,
                                       future_blocked=call.future_blocked, content_folded=content_folded)
    else:
        rel = encoding.relative_logits(role, layer, all_heads(q, 1, kept, call.full_heads),
                                       all_heads(call.k_target, 1, kept, call.full_heads), q_pos, k_pos,
                                       future_blocked=call.future_blocked)
        rel = rel[:, kept] if rel is not None else None
    additive = None
    for term in (bias, rel):
        if term is not None:
            term = term.to(q.dtype)
            if call.source_keys:
                term = F.pad(term, (call.source_keys, 0))
            additive = term if additive is None else additive + term
    return additive


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
