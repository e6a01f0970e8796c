"""Facts about fairseq's attention masks, and the fill value of a blocked logit.

The mask the decoder stack makes for its self-attention (fairseq's `buffered_future_mask`: 0 on
and below the diagonal, -inf above) is named in the stack's pass context, so a call given it knows
these facts without reading it (`made_by_stack`); any other mask is read (one device sync)."""
from typing import Optional

import torch
from torch import Tensor


def blocked_fill_value(dtype: torch.dtype) -> float:
    """Finite 'minus infinity' for masks: exp() of it underflows to 0 in softmax, and unlike -inf
    a fully masked row gives uniform weights instead of NaN, in fp16/bf16 as in fp32."""
    return torch.finfo(dtype).min


def blocked_by(attn_mask: Tensor) -> Tensor:
    """Where `attn_mask` blocks a key: True in a boolean mask, -inf in a float one."""
    return attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)


def future_entries(queries: int, keys: int, device) -> Tensor:
    """(queries, keys) True at every key after its query, the queries being the last of the keys."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).triu(keys - queries + 1)


def blocks_future(attn_mask: Optional[Tensor], queries: int, keys: int, made_by_stack: bool = False) -> bool:
    """Whether the 2-D `attn_mask` (queries, keys) blocks (-inf or True) every key after its query,
    the queries being the last `queries` of the keys: fairseq's future mask. `made_by_stack`: it is
    the decoder stack's future mask of this pass (not read)."""
    if attn_mask is None or attn_mask.dim() != 2 or tuple(attn_mask.shape) != (queries, keys) or queries < 2:
        return False
    if made_by_stack:
        return True
    return bool(blocked_by(attn_mask)[future_entries(queries, keys, attn_mask.device)].all())


def only_blocks(attn_mask: Tensor, made_by_stack: bool = False) -> bool:
    """Whether the float `attn_mask` holds nothing but 0 and -inf (fairseq's future mask): its
    finite part adds nothing to the logits. `made_by_stack`: as in `blocks_future`."""
    return made_by_stack or bool((torch.isneginf(attn_mask) | (attn_mask == 0)).all())


def is_future_mask(attn_mask: Optional[Tensor], made_by_stack: bool = False) -> bool:
    """Whether `attn_mask` is exactly fairseq's future mask over a square of queries and keys: -inf
    (or True) above the diagonal, 0 (or False) on and below it; what SDPA's `is_causal` stands for.
    `made_by_stack`: as in `blocks_future`. A layer recomputed under checkpointing gets the same
    answer from reading the mask as its first run got from the stack, so it takes the same kernel."""
    if attn_mask is None or attn_mask.dim() != 2 or attn_mask.size(0) != attn_mask.size(1):
        return False
    if made_by_stack:
        return True
    future = future_entries(attn_mask.size(0), attn_mask.size(1), attn_mask.device)
    return torch.equal(blocked_by(attn_mask), future) and (attn_mask.dtype == torch.bool or only_blocks(attn_mask))
