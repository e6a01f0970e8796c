"""Facts about fairseq's attention masks, and the fill value of a blocked logit."""
from typing import Callable, Optional

import torch
from torch import Tensor


def blocked_fill_value(dtype: torch.dtype) -> float:
    """Finite 'minus infinity' for masks: exp() of it underflows to 0 in softmax, and unlike -inf
    a fully masked row gives uniform weights instead of NaN, in fp16/bf16 as in fp32."""
    return torch.finfo(dtype).min


def _remembered_about_mask(attn_mask: Tensor, question: str, *geometry, answer: Callable[[], bool]) -> bool:
    """`answer()` about `attn_mask`, computed once per mask tensor, in-place version, view geometry
    and `geometry` (one device sync) and remembered on the mask's storage owner: fairseq slices its
    buffered mask anew each call."""
    owner = attn_mask if attn_mask._base is None else attn_mask._base
    version = None if owner.is_inference() else owner._version  # inference tensors have no version
    key = (question, attn_mask.storage_offset(), tuple(attn_mask.stride()), tuple(attn_mask.shape), attn_mask.dtype,
           version, *geometry)
    remembered = owner.__dict__.setdefault("_posenc_mask_facts", {}) if version is not None else {}
    if key not in remembered:
        remembered[key] = answer()
    return remembered[key]


@torch.compiler.disable  # (the remembered answer lives on the tensor, which torch.compile cannot trace)
def blocks_future(attn_mask: Optional[Tensor], queries: int, keys: int) -> bool:
    """Whether the 2-D `attn_mask` (queries, keys) blocks (-inf or True) every key after its query,
    the queries being the last `queries` of the keys: fairseq's future mask. Checked once per mask
    (`_remembered_about_mask`)."""
    if attn_mask is None or attn_mask.dim() != 2 or tuple(attn_mask.shape) != (queries, keys) or queries < 2:
        return False

    def answer():
        blocked = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        future = torch.ones(queries, keys, dtype=torch.bool, device=attn_mask.device).triu(keys - queries + 1)
        return bool(blocked[future].all())
    return _remembered_about_mask(attn_mask, "blocks future", answer=answer)


@torch.compiler.disable
def only_blocks(attn_mask: Tensor) -> bool:
    """Whether the float `attn_mask` holds nothing but 0 and -inf (fairseq's future mask): its
    finite part adds nothing to the logits. Checked once per mask (`_remembered_about_mask`)."""
    return _remembered_about_mask(attn_mask, "only blocks", answer=lambda: bool(
        (torch.isneginf(attn_mask) | (attn_mask == 0)).all()))
