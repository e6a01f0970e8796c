"""PyTorch's fused attention (SDPA) with the dense terms as its float mask."""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor


def fused_mask_gradient(q: Tensor) -> bool:
    """Whether SDPA has a fused kernel that returns the float mask's gradient on `q`'s device: CUDA's
    memory-efficient kernel does (its O(n) memory apart from the mask); on CPU a mask with gradient
    takes the unfused math path, which keeps more memory than the explicit softmax."""
    return q.device.type == "cuda"


def attend(q: Tensor, k: Tensor, v: Tensor, terms: Optional[Tensor], dropout_p: float, causal: bool = False) -> Tensor:
    """softmax(q k^T + terms) v, (B, H, Tq, D); `q` already scaled, `terms` broadcasting against
    (B, H, Tq, Tk) or None; `causal`: no terms, and key j > query i blocked (Tq = Tk)."""
    if causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, dropout_p=dropout_p)
    if terms is not None:
        terms = terms.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=terms, scale=1.0, dropout_p=dropout_p)
