"""The fused attention path: PyTorch FlexAttention with the position terms read inside the kernel.

For the encodings with a distance term (T5, T5-NoB, AT5, AT5-NoB, ALiBi, Shaw without its value
term, LFHC, XL, GCDF) the FLEX kernel (plan.py) hands FlexAttention a `score_mod` that adds each
logit's term from the encoding's per-distance table (its `DistanceTerm` as a `DistanceLogits`,
`distance.flex_table`) and applies the masks, instead of building the (B, H, Tq, Tk) additive tensor
that the SDPA and explicit paths are given. What the table costs: T5/AT5/ALiBi (1, H, 1, Tq+Tk-1),
Shaw/LFHC (B, H, Tq, at most 2k+1 rows), XL/GCDF (B, H, Tq, Tq+Tk-1): the query meets every
distance, so XL/GCDF still keep O(n^2) per layer on this path (about the logits' size, twice it
for Tq = Tk).

Where it is used: the environment variable POSENC_FLEX_ATTENTION, read by `mode()` when a stack
starts a forward pass (its value travels in the pass context and the `AttentionCall`):
    "off" (default)   never
    "on"              where no gradient is needed (inference, validation): on CUDA compiled with
                      `torch.compile(flex_attention)` (once, lazily), elsewhere in eager mode
    "train"           also with gradients on CUDA. Experimental: on a GPU its gradients differed
                      from the reference paths for AT5 and GCDF (scripts/gpu_check.py,
                      docs/gpu_check.md). For measuring, not for training
Off by default: the default paths are the tested ones, and this one becomes a default only after a
GPU run has shown it equal to them (forward and backward, varying shapes, every precision) and
faster (`scripts/gpu_check.py --device cuda`, docs/gpu_check.md).
It is used only where nothing needs the explicit path (`plan._flex_serves`): no
attention weights or logits asked for, no relative value term (Shaw's default, LFHC's
`--lfhc-values on`), no attention dropout (training with --attention-dropout > 0,
--retain-dropout), no --cross-self-attention, a 2-D attn_mask, and on CUDA a head
dimension of at least 16 (FlexAttention's kernel). Everything else takes the existing paths.
A compilation that fails raises an error naming POSENC_FLEX_ATTENTION: no silent switch of kernels
mid-training (every rank would decide on its own).

Masks are exact, as in `terms.with_masks`: the attn_mask's -inf (or True) entries and
the padded keys get a finite fill (a fully masked row gives uniform weights as on the explicit
path, not NaN or zeros), its finite entries are added. No BlockMask: masked blocks (the causal upper triangle)
are computed and then filled rather than skipped.
"""
import functools
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from ..encodings.distance import DistanceLogits
from ..switches import FLEX_ATTENTION, FLEX_ATTENTION_MODES, flex_attention_mode

#: the switch (switches.py): its variable, values, reader (`mode()`, read when a stack starts a pass)
SWITCH, MODES, mode = FLEX_ATTENTION, FLEX_ATTENTION_MODES, flex_attention_mode
#: FlexAttention's CUDA kernel needs a head dimension of at least this
MIN_CUDA_HEAD_DIM = 16


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """torch.compile(flex_attention), made at the first CUDA call."""
    return torch.compile(flex_attention)


def available(q: Tensor, flex_mode: str, grad_enabled: bool) -> bool:
    """Whether `flex_mode` (one of MODES) lets the queries `q` (B, H, Tq, D) take the fused path on
    their device, with gradients on or off (`grad_enabled`)."""
    if flex_mode == "off":
        return False
    if q.is_cuda:
        return q.size(-1) >= MIN_CUDA_HEAD_DIM and (flex_mode == "train" or not grad_enabled)
    return not grad_enabled  # (FlexAttention's eager CPU path has no backward)


def attend(q: Tensor, k: Tensor, v: Tensor, distance: Optional[DistanceLogits], attn_mask: Optional[Tensor],
           key_padding_mask: Optional[Tensor], fill: float) -> Tensor:
    """softmax(q.k + distance term + attn_mask) v, (B, H, Tq, D), q already scaled; blocked
    entries (attn_mask -inf or True, padded keys) at `fill`. `attn_mask` (Tq, Tk): these queries'
    rows; `key_padding_mask` (B, Tk), True (non-zero) at padding."""
    # FlexAttention scales the scores by log2(e) before exp2: finfo.min would overflow to -inf, and a
    # fully masked row would give zeros instead of the explicit path's uniform weights
    score_mod = _score_mod(q, distance, attn_mask, key_padding_mask, fill / 2)
    if q.is_cuda:
        try:
            return compiled_flex_attention()(q, k, v, score_mod=score_mod, scale=1.0)
        except torch._dynamo.exc.TorchDynamoException as error:  # compilation only, not CUDA faults
            raise RuntimeError(f"posenc_fairseq: torch.compile(flex_attention) failed ({type(error).__name__}); "
                               "unset POSENC_FLEX_ATTENTION (off is the default) to use the default attention "
                               "paths") from error
    with warnings.catch_warnings():  # eager: the unfused reference (off CUDA)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, score_mod=score_mod, scale=1.0)


def _score_mod(q: Tensor, distance: Optional[DistanceLogits], attn_mask: Optional[Tensor],
               key_padding_mask: Optional[Tensor], fill: float):
    if distance is not None:
        table = distance.table.to(q.dtype)
        key_bias = distance.key_bias.to(q.dtype) if distance.key_bias is not None else None
        column = distance.column
        # shared (size-1) dimensions are dropped rather than read at index 0
        shared_batch, shared_query = table.size(0) == 1, table.size(2) == 1
        table = table[(0 if shared_batch else slice(None), slice(None), 0 if shared_query else slice(None))]
        # a tensor, not a Python int: the compiled kernel is not specialised to each length
        offset = torch.full((), q.size(2) - 1, dtype=torch.long, device=q.device)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    padding = key_padding_mask.to(torch.bool) if key_padding_mask is not None else None

    def score_mod(score, b, h, q_idx, kv_idx):
        if distance is not None:
            c = kv_idx - q_idx + offset  # the distance key - query, numbered from the lowest
            if column is not None:
                c = column[c]
            index = ((b,) if not shared_batch else ()) + (h,) + ((q_idx,) if not shared_query else ()) + (c,)
            score = score + table[index]
            if key_bias is not None:
                score = score + key_bias[b, h, kv_idx]
        blocked = None
        if attn_mask is not None:
            entry = attn_mask[q_idx, kv_idx]
            if attn_mask.dtype == torch.bool:
                blocked = entry
            else:
                blocked = torch.isneginf(entry)
                score = score + entry
        if padding is not None:
            blocked = padding[b, kv_idx] if blocked is None else blocked | padding[b, kv_idx]
        if blocked is not None:
            score = torch.where(blocked, fill, score)
        return score

    return score_mod
