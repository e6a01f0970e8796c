"""PyTorch's fused attention (SDPA) with the dense terms as its float mask."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .terms import with_masks_for_log_sum_exp

#: CUDA's memory-efficient kernel reads the float mask in 16-byte vectors from its start and from
#: each row's. PyTorch pads a mask whose row length is not a multiple of 16 elements, but passes any
#: other mask as it is: a strided view (`positions.relative_shift`'s diagonal one, with an odd row
#: stride and start) then fails with "misaligned address".
MASK_ALIGNMENT_BYTES = 16


def fused_mask_gradient(q: Tensor) -> bool:
    """Whether SDPA has a fused kernel that returns the float mask's gradient on `q`'s device: CUDA's
    memory-efficient kernel does (its O(n) memory apart from the mask); on CPU a mask with gradient
    takes the unfused math path, which keeps more memory than the explicit softmax."""
    return q.device.type == "cuda"


def aligned_mask(terms: Tensor) -> Tensor:
    """`terms` with its start and every stride but the last (1) a multiple of 16 bytes, as CUDA's
    fused kernels read it: `terms` itself where it is so, else a copy whose rows are padded to a
    multiple of 16 bytes (sliced back to their length; the copy carries the gradient). Broadcast
    dimensions (size 1, or stride 0 after `expand`) need no alignment."""
    elements = max(1, MASK_ALIGNMENT_BYTES // terms.element_size())
    strides_aligned = all(stride % elements == 0 for size, stride in zip(terms.shape[:-1], terms.stride()[:-1])
                          if size > 1)
    if terms.stride(-1) == 1 and strides_aligned and terms.storage_offset() % elements == 0:
        return terms
    keys = terms.size(-1)
    padding = -keys % elements
    if not padding:  # (a clone: `contiguous` would keep a contiguous view's unaligned start)
        return terms.clone(memory_format=torch.contiguous_format)
    return F.pad(terms, (0, padding))[..., :keys]


def attend(q: Tensor, k: Tensor, v: Tensor, terms: Optional[Tensor], dropout_p: float, causal: bool = False) -> Tensor:
    """softmax(q k^T + terms) v, (B, H, Tq, D); `q` already scaled, `terms` broadcasting against
    (B, H, Tq, Tk) or None; `causal`: no terms, and key j > query i blocked (Tq = Tk)."""
    if causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, dropout_p=dropout_p)
    if terms is not None:
        if q.is_cuda:
            terms = aligned_mask(terms)
        terms = terms.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=terms, scale=1.0, dropout_p=dropout_p)


def attend_masked(call, q: Tensor, k: Tensor, v: Tensor, terms: Optional[Tensor]) -> Tensor:
    """`attend` of the `AttentionCall` `call` (its q, k, v as given: with its terms folded in where
    the caller did) with its masks added to `terms`; the rows that see no key get uniform weights,
    forward and backward (`terms.with_masks_for_log_sum_exp`)."""
    if call.attn_mask is None and call.key_padding_mask is None:
        return attend(q, k, v, terms, call.dropout_p)
    terms, without_keys = with_masks_for_log_sum_exp(call, terms)
    return attend(q.masked_fill(without_keys, 0), k, v, terms, call.dropout_p)
