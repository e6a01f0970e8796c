"""The dense form of what is added to the scaled logits: the encoding's position term
(`distance.dense_logits`) and the masks, as one tensor that broadcasts against
(B, H, Tq, Tk). The kernels that read the terms in another form (FLEX, STEP) do not build it."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..encodings.cache import TermKey
from ..encodings.distance import dense_logits
from .masks import blocked_by, blocked_fill_value, only_blocks


def position_terms(call, content_folded: bool) -> Optional[Tensor]:
    """The encoding's logit term of the `AttentionCall` `call` in the dense form, (B or 1, H, Tq, Tk),
    zero on the --cross-self-attention source keys; None: none. `content_folded`: the caller adds
    the term's content vector to the queries of its product with the keys."""
    if call.term is None:
        return None
    term = dense_logits(call.term, call.q, call.k_target, call.future_blocked, content_folded,
                        memoize=call.memoize)
    if term is None:  # (a content vector alone, folded into the queries)
        return None
    term = term.to(call.q.dtype)
    return F.pad(term, (call.source_keys, 0)) if call.source_keys else term


def with_masks(call, additive: Optional[Tensor]) -> Optional[Tensor]:
    """`additive` (or nothing) plus the attention mask's finite part, with the blocked entries (mask
    and padding) at the dtype's finite minimum; (B or 1, H or 1, Tq, Tk). None: nothing to add.
    The kernels that write the logits out fill them in place instead (`masked_logits`)."""
    return _with_blocked(call, additive, rows_without_keys_at_zero=False)[0]


def with_masks_for_log_sum_exp(call, additive: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """`with_masks` for a kernel that keeps each row's log-sum-exp for its backward (SDPA's fused
    kernels): a row whose keys are all blocked holds 0 instead of the fill, and the caller zeroes its
    query (the second result: True at such rows, (B or 1, 1, Tq or 1, 1); None without masks). Its
    logits are then all 0: uniform weights over all keys, forward and backward, as the explicit
    softmax gives it. With the fill, the row's log-sum-exp is the fill, which absorbs log Tk (float32
    cannot hold both), and the backward's exp(s - L) weighs each key 1 instead of 1 / Tk."""
    return _with_blocked(call, additive, rows_without_keys_at_zero=True)


def _with_blocked(call, additive: Optional[Tensor], rows_without_keys_at_zero: bool):
    shared = _shared_key(call, rows_without_keys_at_zero)
    if shared is not None:  # one copy for the stack's layers, which keep it for their backward
        return call.memoize(shared, lambda: _blocked(call, additive, rows_without_keys_at_zero))
    return _blocked(call, additive, rows_without_keys_at_zero)


def _shared_key(call, rows_without_keys_at_zero: bool):
    """The pass-scope key of `_with_blocked`'s result where every layer of the stack computes the same:
    a memoized bias-only term (`dense_logits`'s condition) under the stack's own future mask alone; None
    elsewhere (padding or another mask: tensors a key cannot name)."""
    term = call.term
    if (call.memoize is None or term is None or term.key is None or term.vectors is not None
            or term.content is not None or not call.stack_mask or call.key_padding_mask is not None
            or call.source_keys):
        return None
    return TermKey(term.key.role, term.key.encoding, "dense with the future mask",
                   (term.key, term.low, term.high, call.q.size(2), call.q.dtype, rows_without_keys_at_zero))


def _blocked(call, additive: Optional[Tensor], rows_without_keys_at_zero: bool):
    additive = with_finite_mask(call, additive)
    blocked = blocked_entries(call)
    if blocked is None:
        return additive, None
    if additive is None:
        additive = torch.zeros((), dtype=call.q.dtype, device=call.q.device)
    fill = blocked_fill_value(call.q.dtype)
    if not rows_without_keys_at_zero:
        return additive.masked_fill(blocked, fill), None
    without_keys = blocked.all(-1, keepdim=True)
    fills = torch.full(without_keys.shape, fill, dtype=call.q.dtype, device=call.q.device).masked_fill(without_keys, 0)
    return torch.where(blocked, fills, additive), without_keys


def masked_logits(call, logits: Tensor) -> Tensor:
    """The logits `logits` (B, H, Tq, Tk), not needed elsewhere, with the blocked entries (mask and
    padding) filled in place: what `with_masks` gives when added, without a tensor of the masks."""
    blocked = blocked_entries(call)
    return logits if blocked is None else logits.masked_fill_(blocked, blocked_fill_value(logits.dtype))


def with_finite_mask(call, additive: Optional[Tensor]) -> Optional[Tensor]:
    """`additive` plus the finite entries of a float attn_mask that holds more than 0 and -inf."""
    attn_mask = call.attn_mask
    if attn_mask is None or attn_mask.dtype == torch.bool or only_blocks(attn_mask, call.stack_mask):
        return additive  # (fairseq's future mask: no full-size addition of zeros)
    finite = attn_mask.masked_fill(torch.isneginf(attn_mask), 0).to(call.q.dtype)
    return finite if additive is None else additive + finite


def blocked_entries(call) -> Optional[Tensor]:
    """Where the attn_mask (-inf or True) or the key padding blocks a key, broadcasting against
    (B, H, Tq, Tk); None: nowhere."""
    attn_mask, key_padding_mask = call.attn_mask, call.key_padding_mask
    blocked = None
    if attn_mask is not None:
        blocked = blocked_by(attn_mask)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(key_padding_mask.size(0), 1, 1, -1)
        if padding.dtype != torch.bool:
            padding = padding.to(torch.bool)
        blocked = padding if blocked is None else (blocked | padding)
    return blocked
