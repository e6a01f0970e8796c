"""Fused CPU attention for position terms that need a gradient (training T5, AT5, XL, GCDF, ...).

    out = softmax(q k^T + A) v        (q already scaled; A: the position terms plus the masks)

PyTorch's fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`) takes A as its mask but
gives no gradient for it, so SDPA falls back to its unfused form whenever A requires a gradient:
the (B, H, Tq, Tk) logits, probabilities and their gradients are then written out in full, several
passes over memory each (at n = 2048 one such pass costs about as much as one of the products).

`BiasedAttention` runs the fused kernel forward (it keeps the row log-sum-exp L) and does the
backward by hand one block of queries at a time, so each block's probabilities stay small:

    P = exp(q k^T + A - L)            (recomputed, exactly the forward's probabilities)
    dv = P^T do,   dP = do v^T,   dS = P * (dP - rowsum(do * out))
    dq = dS k,     dk = dS^T q,   dA = dS   (summed over the dimensions A broadcasts)

Used by `PositionalAttention` on CPU in float32 without attention dropout (the kernel has none);
otherwise the explicit softmax serves (tests: `tests/test_biased_attention.py`, against autograd of
the explicit formula).
"""
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

#: elements of one block's (B, H, rows, Tk) probabilities in the backward (4 MiB in float32)
BLOCK_ELEMENTS = 2 ** 20
MIN_BLOCK_ROWS = 16


def applies(q: Tensor, additive, dropout_p: float) -> bool:
    """Whether `attend` serves this call: CPU, float32, a term with gradient, no attention dropout."""
    return (additive is not None and additive.requires_grad and torch.is_grad_enabled() and dropout_p == 0.0
            and q.device.type == "cpu" and q.dtype == torch.float32 and additive.dtype == torch.float32)


def _block_rows(q: Tensor, keys: int) -> int:
    return max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, q.size(0) * q.size(1) * keys))


class BiasedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, additive: Tensor) -> Tensor:
        mask = additive.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        if mask.stride(-1) != 1:  # (the kernel reads the mask's rows as contiguous)
            mask = mask.contiguous()
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=1.0)
        ctx.save_for_backward(q, k, v, additive, out, logsumexp)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, additive, out, logsumexp = ctx.saved_tensors
        need_q, need_k, need_v, need_additive = ctx.needs_input_grad
        grad_out = grad_out.contiguous()
        row_term = (grad_out * out).sum(-1, keepdim=True)  # rowsum(do * out), (B, H, Tq, 1)
        logsumexp = logsumexp.unsqueeze(-1)
        # A row whose keys are all blocked (filled with the dtype's finite minimum) has L equal to
        # that minimum, which absorbs log(Tk): exp(S - L) would give 1 instead of 1/Tk there. Such
        # rows (a padded query under the future mask) take the softmax, as the explicit path does.
        sees_no_key = bool((logsumexp < torch.finfo(logsumexp.dtype).min / 2).any())
        k_t, v_t = k.transpose(-1, -2), v.transpose(-1, -2)
        grad_q = torch.empty_like(q) if need_q else None
        grad_k = torch.zeros_like(k) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
        grad_additive = torch.zeros(additive.shape, dtype=additive.dtype) if need_additive else None
        per_row = additive.size(-2) != 1  # (a term shared by every query sums over them)
        queries = q.size(2)
        step = _block_rows(q, k.size(2))
        for start in range(0, queries, step):
            rows = slice(start, min(start + step, queries))
            q_rows, grad_rows = q[:, :, rows], grad_out[:, :, rows]
            probs = torch.matmul(q_rows, k_t)
            probs += additive[..., rows, :] if per_row else additive
            if sees_no_key:
                probs = torch.softmax(probs, dim=-1)
            else:
                probs -= logsumexp[:, :, rows]
                probs.exp_()
            if need_v:
                grad_v += probs.transpose(-1, -2) @ grad_rows
            grad_logits = torch.matmul(grad_rows, v_t)
            grad_logits -= row_term[:, :, rows]
            grad_logits *= probs  # dS
            if need_q:
                grad_q[:, :, rows] = grad_logits @ k
            if need_k:
                grad_k += grad_logits.transpose(-1, -2) @ q_rows
            if need_additive:
                if per_row:
                    target = grad_additive[..., rows, :]
                    target.copy_(grad_logits.sum_to_size(target.shape))
                else:
                    grad_additive += grad_logits.sum_to_size(grad_additive.shape)
        return grad_q, grad_k, grad_v, grad_additive


def attend(q: Tensor, k: Tensor, v: Tensor, additive: Tensor) -> Tensor:
    """softmax(q k^T + additive) v of (B, H, T, D) q/k/v (q scaled) and an `additive` that
    broadcasts against (B, H, Tq, Tk), with gradients for all four."""
    return BiasedAttention.apply(q, k, v, additive)
