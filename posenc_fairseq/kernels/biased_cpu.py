"""Fused CPU attention for position terms that need a gradient (training T5, AT5, XL, GCDF, ...).

    out = softmax(q k^T + A) v        (q already scaled; A: the position terms plus the masks)

PyTorch's fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`) takes A as its mask but
gives no gradient for it, so SDPA falls back to its unfused form whenever A requires a gradient:
the (B, H, Tq, Tk) logits, probabilities and their gradients are then written out in full, several
passes over memory each, at long lengths as costly as the products themselves (docs/benchmarks.md).

`BiasedAttention` runs the fused kernel forward (it keeps the row log-sum-exp L) and does the
backward by hand one block of queries at a time, so each block's probabilities stay small:

    P = exp(q k^T + A - L)            (recomputed, exactly the forward's probabilities)
    dv = P^T do,   dP = do v^T,   dS = P * (dP - rowsum(do * out))
    dq = dS k,     dk = dS^T q,   dA = dS   (summed over the dimensions A broadcasts)

A row whose keys are all blocked gives the mean of v (uniform weights over every key, as the explicit
softmax of the filled logits does) and, like the explicit path, no gradient to q, k or A (dS = 0).

Chosen by plan.py on CPU in float32 without attention dropout (the kernel has none), for
calls of at least MIN_LOGITS logits; otherwise the explicit softmax serves (tests:
`tests/kernels/test_biased_cpu.py`, against autograd of the explicit formula). Under fairseq's future
mask (`future_blocked`) the forward sets the kernel's causal flag and each backward block leaves out
the keys after its last query.
"""
from typing import Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..block_size import BLOCK_ELEMENTS, rows_per_block

#: the backward's blocks: the rows whose (B, H, rows, Tk) probabilities hold BLOCK_ELEMENTS, at least this many
MIN_BLOCK_ROWS = 16


#: (B, H, Tq, Tk) logits of a whole call (all its blocks of queries) from which `attend` serves
#: it: the explicit softmax wins on smaller calls, whose logits stay in cache (docs/benchmarks.md).
MIN_LOGITS = 2 ** 23


def serves_call(q: Tensor, dropout_p: float, logits: int, grad_enabled: bool) -> bool:
    """Whether `attend` serves a call of queries `q` whose terms need a gradient: with gradients on
    (`grad_enabled`), CPU, float32, no attention dropout, and `logits` (the whole call's
    B * H * Tq * Tk) at least MIN_LOGITS."""
    return (grad_enabled and dropout_p == 0.0 and q.device.type == "cpu" and q.dtype == torch.float32
            and logits >= MIN_LOGITS)


def _block_rows(q: Tensor, keys: int) -> int:
    return rows_per_block(BLOCK_ELEMENTS, q.size(0) * q.size(1) * keys, MIN_BLOCK_ROWS)


def _flash(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, causal: bool) -> Tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=1.0)


def _without_keys(logsumexp: Tensor) -> Tensor:
    """Where a row's keys are all blocked (filled with the dtype's finite minimum): its L equals
    that minimum, which absorbs log(Tk), so exp(S - L) would give 1 instead of 1/Tk there."""
    return logsumexp < torch.finfo(logsumexp.dtype).min / 2


def _sees_no_key(logsumexp: Tensor) -> bool:
    """Whether some row's keys are all blocked (`_without_keys`)."""
    return bool(_without_keys(logsumexp).any())


def _with_column(x: Tensor, column) -> Tensor:
    """`x` (B, H, T, D) with one more column: (B, H, T, D + 1). Products with such operands fold a
    per-row term into the product (q.k - L_i = [q, -L].[k, 1]): no separate pass over the block."""
    extra = column if isinstance(column, Tensor) else x.new_full((*x.shape[:-1], 1), column)
    return torch.cat([x, extra.expand(*x.shape[:-1], 1)], dim=-1)


def _probabilities(out: Tensor, logits_query: Tensor, keys_t: Tensor, term: Tensor, sees_no_key: bool) -> Tensor:
    """A block's P = exp(q k^T + A - L) into `out` (B, H, rows, keys), exactly the forward's
    probabilities (L folded into the product: `logits_query` = [q, -L], `keys_t` = [k, 1]^T); where
    a row sees no key (L not folded in) the softmax over every key."""
    torch.matmul(logits_query, keys_t, out=out)
    out += term
    if sees_no_key:
        out.copy_(torch.softmax(out, dim=-1))
    else:
        out.exp_()
    return out


def _add_term_gradient(grad_additive: Tensor, grad_logits: Tensor, rows: slice, keys: int, per_row: bool,
                       written: bool, summed: list) -> None:
    """Adds a block's logit gradients dS (B, H, rows, keys) to the term's gradient, summed over the
    dimensions the term broadcasts (`summed`; also over the queries for a term shared by them), zero
    at the keys the block leaves out. `written`: dS already lies in the term's gradient."""
    if per_row:
        target = grad_additive[..., rows, :]
        if not written:
            torch.sum(grad_logits, dim=summed, keepdim=True, out=target[..., :keys])
        target[..., keys:].zero_()
    else:
        grad_additive[..., :keys] += grad_logits.sum([*summed, 2], keepdim=True)


class BiasedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, additive: Tensor, future_blocked: bool) -> Tensor:
        if additive._base is not None and additive._base.numel() > additive.numel():
            # a window of a larger tensor (Shaw/LFHC's shifted relative logits span Tq + Tk - 1
            # distances per row): backward keeps only what the window shows
            additive = additive.contiguous()
        mask = additive.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        if mask.stride(-1) != 1:  # (the kernel reads the mask's rows as contiguous)
            mask = mask.contiguous()
        # The kernel's own causal flag skips the blocked keys' tiles (queries and keys aligned at
        # the start: only for Tq == Tk). A row that sees no key at all is uniform over every key in
        # the explicit softmax but over the unskipped ones here: such calls are run again in full.
        causal = future_blocked and q.size(2) == k.size(2)
        out, logsumexp = _flash(q, k, v, mask, causal)
        if causal and _sees_no_key(logsumexp):
            out, logsumexp = _flash(q, k, v, mask, False)
        ctx.future_blocked = future_blocked
        ctx.save_for_backward(q, k, v, additive, out, logsumexp)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, additive, out, logsumexp = ctx.saved_tensors
        term_shape = additive.shape
        additive = additive.view(*(1,) * (4 - additive.dim()), *term_shape)  # (B or 1, H or 1, Tq or 1, Tk)
        need_q, need_k, need_v, need_additive, _ = ctx.needs_input_grad
        batch, heads, queries, _ = q.shape
        keys_total, flat = k.size(2), batch * heads
        grad_out = grad_out.contiguous()
        row_term = (grad_out * out).sum(-1, keepdim=True)  # rowsum(do * out), (B, H, Tq, 1)
        # Rows that see no key take the softmax over every key, as the explicit path does.
        without_keys = _without_keys(logsumexp).unsqueeze(-1)  # (B, H, Tq, 1)
        sees_no_key = bool(without_keys.any())
        # ... and, their output being the mean of v whatever q, k and the terms, no logit gradient
        without_keys = without_keys if sees_no_key else None
        # Under the future mask a block of queries needs the keys up to its last query only (the
        # queries are the last Tq of the keys); the others' probabilities and gradients are zero.
        skip_future = ctx.future_blocked and not sees_no_key
        logits_query = q if sees_no_key else _with_column(q, -logsumexp.unsqueeze(-1))  # q.k - L
        keys_t = (k if sees_no_key else _with_column(k, 1.0)).transpose(-1, -2)
        grad_query = _with_column(grad_out, -row_term)  # do.v - rowsum(do * out)
        values_t = _with_column(v, 1.0).transpose(-1, -2)
        grad_q = torch.empty_like(q) if need_q else None
        grad_k = torch.zeros_like(k) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
        per_row = additive.size(-2) != 1  # (a term shared by every query sums over them)
        summed = [d for d in range(2) if additive.size(d) == 1 and q.size(d) != 1]  # dims A broadcasts
        grad_additive = None
        if need_additive:  # (every element is written below where the term has a row per query)
            grad_additive = (torch.empty if per_row else torch.zeros)(additive.shape, dtype=additive.dtype)
        step = _block_rows(q, keys_total)
        # one block's probabilities and logit gradients, reused by every block (a fresh tensor of
        # this size costs page faults at every allocation)
        probs_buffer = q.new_empty(batch, heads, min(step, queries), keys_total)
        grads_buffer = q.new_empty(batch, heads, min(step, queries), keys_total)
        for start in range(0, queries, step):
            rows = slice(start, min(start + step, queries))
            count = rows.stop - rows.start
            keys = min(keys_total, keys_total - queries + rows.stop) if skip_future else keys_total
            probs = _probabilities(probs_buffer[:, :, :count, :keys], logits_query[:, :, rows], keys_t[..., :keys],
                                   additive[..., rows, :keys] if per_row else additive[..., :keys], sees_no_key)
            q_rows, grad_rows = q[:, :, rows], grad_out[:, :, rows]
            if need_v:
                grad_v.view(flat, keys_total, -1)[:, :keys].baddbmm_(
                    probs.reshape(flat, count, keys).transpose(1, 2), grad_rows.reshape(flat, count, -1))
            # dS = P * (dP - rowsum(do * out)), written where the term's gradient goes if it has
            # the block's shape
            direct = need_additive and per_row and not summed
            grad_logits = (grad_additive[..., rows, :keys] if direct else grads_buffer[:, :, :count, :keys])
            torch.matmul(grad_query[:, :, rows], values_t[..., :keys], out=grad_logits)
            grad_logits *= probs
            if without_keys is not None:
                grad_logits.masked_fill_(without_keys[:, :, rows], 0)
            if need_q:
                torch.matmul(grad_logits, k[:, :, :keys], out=grad_q[:, :, rows])
            if need_k:
                grad_k.view(flat, keys_total, -1)[:, :keys].baddbmm_(
                    grad_logits.reshape(flat, count, keys).transpose(1, 2), q_rows.reshape(flat, count, -1))
            if need_additive:
                _add_term_gradient(grad_additive, grad_logits, rows, keys, per_row, direct, summed)
        if grad_additive is not None:
            grad_additive = grad_additive.view(term_shape)
        return grad_q, grad_k, grad_v, grad_additive, None


def attend(q: Tensor, k: Tensor, v: Tensor, additive: Tensor, future_blocked: bool = False) -> Tensor:
    """softmax(q k^T + additive) v of (B, H, T, D) q/k/v (q scaled) and an `additive` that
    broadcasts against (B, H, Tq, Tk), with gradients for all four. `future_blocked`: `additive`
    blocks every key after its query (the queries being the last Tq of the keys), so the work on
    those keys may be skipped."""
    return BiasedAttention.apply(q, k, v, additive, future_blocked)
