"""Facts about fairseq's attention masks, and the fill value of a blocked logit."""
import weakref
from typing import Callable, Dict, Optional

import torch
from torch import Tensor


def blocked_fill_value(dtype: torch.dtype) -> float:
    """Finite 'minus infinity' for masks: exp() of it underflows to 0 in softmax, and unlike -inf
    a fully masked row gives uniform weights instead of NaN, in fp16/bf16 as in fp32."""
    return torch.finfo(dtype).min


#: answers about live masks: id of the mask's storage owner -> {question and view: answer}; an
#: entry goes with its owner (weakref.finalize), so a new tensor at the same id starts empty
_MASK_FACTS: Dict[int, Dict[tuple, bool]] = {}


def _remembered_about_mask(attn_mask: Tensor, question: str, *geometry, answer: Callable[[], bool]) -> bool:
    """`answer()` about `attn_mask`, computed once per mask tensor, in-place version, view geometry
    and `geometry` (one device sync) and remembered for the mask's storage owner while it lives:
    fairseq slices its buffered mask anew each call."""
    owner = attn_mask if attn_mask._base is None else attn_mask._base
    if owner.is_inference():  # inference tensors have no version counter: nothing to remember by
        return answer()
    key = (question, attn_mask.storage_offset(), tuple(attn_mask.stride()), tuple(attn_mask.shape), attn_mask.dtype,
           owner._version, *geometry)
    remembered = _MASK_FACTS.get(id(owner))
    if remembered is None:
        remembered = _MASK_FACTS[id(owner)] = {}
        weakref.finalize(owner, _MASK_FACTS.pop, id(owner), None)
    if key not in remembered:
        remembered[key] = answer()
    return remembered[key]


@torch.compiler.disable  # (the remembered answers are Python state, which torch.compile cannot trace)
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
