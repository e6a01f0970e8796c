"""Triton kernels of the TRITON path (triton_bias.py): attention with a per-distance bias read inside the
kernel, forward and backward, O(n) memory.

    s_ij = q_i . k_j + bias[h, j - i + Tq - 1]      (q already scaled; the queries are the last Tq keys)
    out_i = sum_j softmax_j(s_ij) v_j

Forward: FlashAttention-2's online softmax, one program per (block of queries, batch x head); it keeps
each row's running maximum m and sum l (not their log-sum-exp m + log l: where a row sees no key, m is
the fill value, which in float32 absorbs log l, and the backward would get 1 instead of 1/l).
Backward: P = exp(s - m) / l recomputed; one program per (block of keys, b x h) gives dk, dv and the
bias gradient, looping over the blocks of queries; one per (block of queries, b x h) gives dq.

The bias gradient, sum over b and (i, j) with j - i fixed of dS_ij, without atomics: each tile's dS is
stored skewed (row i shifted by -i) into the program's own scratch rows, whose column sums are the
tile's diagonal sums; the program adds them into its own row of a (B, H, key blocks, Tq + Tk - 1)
buffer, which torch then sums. Float32 (float64 for float64 inputs) throughout, the same result on
every run.

Masks: key padding, and the causal mask (key j after query i + Tk - Tq). A blocked logit is `fill`
(the finite minimum of the inputs' dtype, as the explicit path fills it); tiles wholly in the future
are skipped. Columns past Tk are -inf (they are not keys). Rows that see no key: triton_bias.py.

Runs compiled on CUDA, and on CPU in Triton's interpreter (TRITON_INTERPRET=1 before this module is
imported) for the exactness tests (tests/kernels/test_triton_bias.py).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _logits(q, k_t, offs_m, offs_n, bias_row, pad_row, fill, Tq, Tk,
            HAS_BIAS: tl.constexpr, HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """A tile's logits (BLOCK_M, BLOCK_N) with the bias and the masks, and where they are blocked."""
    s = tl.dot(q, k_t, input_precision=PRECISION)
    inside = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if HAS_BIAS:
        bias = tl.load(bias_row + (offs_n[None, :] - offs_m[:, None] + (Tq - 1)), mask=inside, other=0.0)
        s += bias.to(q.dtype).to(s.dtype)  # rounded to the inputs' dtype first, as the explicit path adds it
    blocked = (offs_m[:, None] < 0) & (offs_n[None, :] < 0)
    if CAUSAL:
        blocked = blocked | (offs_n[None, :] > offs_m[:, None] + (Tk - Tq))
    if HAS_PADDING:
        padded = tl.load(pad_row + offs_n, mask=offs_n < Tk, other=0) != 0
        blocked = blocked | padded[None, :]
    s = tl.where(blocked, fill, s)
    s = tl.where(offs_n[None, :] < Tk, s, float("-inf"))
    return s, blocked


@triton.jit
def _load_rows(base, offs, stride_row, stride_d, offs_d, rows, D):
    return tl.load(base + offs[:, None] * stride_row + offs_d[None, :] * stride_d,
                   mask=(offs[:, None] < rows) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _attention_forward(Q, K, V, Bias, Pad, Fill, Out, M, L,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, sbh, spb,
             H, Tq, Tk, D,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
    fill = tl.load(Fill)
    bias_row, pad_row = Bias + h * sbh, Pad + b * spb
    m_i = tl.zeros([BLOCK_M], dtype=fill.dtype) + float("-inf")
    l_i = tl.zeros([BLOCK_M], dtype=fill.dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=fill.dtype)
    end = Tk
    if CAUSAL:
        end = tl.minimum(Tk, (block + 1) * BLOCK_M + Tk - Tq)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + h * skh, offs_n, skn, skd, offs_d, Tk, D)
        v = _load_rows(V + b * svb + h * svh, offs_n, svn, svd, offs_d, Tk, D)
        s, blocked = _logits(q, tl.trans(k), offs_m, offs_n, bias_row, pad_row, fill, Tq, Tk,
                             HAS_BIAS, HAS_PADDING, CAUSAL, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D))
    row = bh * Tq + offs_m
    tl.store(M + row, m_i, mask=offs_m < Tq)
    tl.store(L + row, l_i, mask=offs_m < Tq)


@triton.jit
def _attention_backward_keys(Q, K, V, Bias, Pad, Fill, dO, M, L, Delta, dK, dV, BiasGrad, Scratch,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, sbh, spb,
                   H, Tq, Tk, D, blocks,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BIAS_GRAD: tl.constexpr, HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr):
    """dk, dv of a block of keys (dO and dQ share the strides of out and q), and its tiles' bias
    gradient sums per distance."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b * skb + h * skh, offs_n, skn, skd, offs_d, Tk, D)
    v = _load_rows(V + b * svb + h * svh, offs_n, svn, svd, offs_d, Tk, D)
    fill = tl.load(Fill)
    bias_row, pad_row = Bias + h * sbh, Pad + b * spb
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=fill.dtype)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=fill.dtype)
    # the bias gradient: this program's scratch (BLOCK_M rows of 2 BLOCK_N) and its row of sums
    columns = Tq + Tk - 1
    scratch = Scratch + (bh * blocks + block) * (BLOCK_M * 2 * BLOCK_N)
    sums_row = BiasGrad + (bh * blocks + block) * columns
    rows_m = tl.arange(0, BLOCK_M)
    width = tl.arange(0, 2 * BLOCK_N)
    start = 0
    if CAUSAL:  # the first query that sees this block's first key
        start = tl.maximum(0, block * BLOCK_N - (Tk - Tq)) // BLOCK_M * BLOCK_M
    for first in range(start, Tq, BLOCK_M):
        offs_m = first + rows_m
        q = _load_rows(Q + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
        do = _load_rows(dO + b * sob + h * soh, offs_m, som, sod, offs_d, Tq, D)
        row = bh * Tq + offs_m
        m_i = tl.load(M + row, mask=offs_m < Tq, other=0.0)
        l_i = tl.load(L + row, mask=offs_m < Tq, other=1.0)
        delta = tl.load(Delta + row, mask=offs_m < Tq, other=0.0)
        s, blocked = _logits(q, tl.trans(k), offs_m, offs_n, bias_row, pad_row, fill, Tq, Tk,
                             HAS_BIAS, HAS_PADDING, CAUSAL, PRECISION)
        p = tl.exp(s - m_i[:, None]) / l_i[:, None]
        p = tl.where(offs_m[:, None] < Tq, p, 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(blocked, 0.0, p * (dp - delta[:, None]))
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        if BIAS_GRAD:
            # row i of the tile shifted left by i: column w = j - i + BLOCK_M - 1 holds one distance
            tl.store(scratch + rows_m[:, None] * (2 * BLOCK_N) + (tl.arange(0, BLOCK_N)[None, :] - rows_m[:, None]
                                                                   + BLOCK_M - 1), ds)
            tl.debug_barrier()
            diagonal = tl.sum(tl.load(scratch + rows_m[:, None] * (2 * BLOCK_N) + width[None, :]), 0)
            column = block * BLOCK_N - first + (Tq - 1) - (BLOCK_M - 1) + width
            keep = (column >= 0) & (column < columns) & (width < BLOCK_M + BLOCK_N - 1)
            total = tl.load(sums_row + column, mask=keep, other=0.0) + diagonal
            tl.debug_barrier()
            tl.store(sums_row + column, total, mask=keep)
            tl.debug_barrier()
    tl.store(dK + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, dk.to(dK.dtype.element_ty),
             mask=(offs_n[:, None] < Tk) & (offs_d[None, :] < D))
    tl.store(dV + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, dv.to(dV.dtype.element_ty),
             mask=(offs_n[:, None] < Tk) & (offs_d[None, :] < D))


@triton.jit
def _attention_backward_queries(Q, K, V, Bias, Pad, Fill, dO, M, L, Delta, dQ,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, sbh, spb,
                      H, Tq, Tk, D,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """dq of a block of queries (dq shares the strides of q, dO those of out)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
    do = _load_rows(dO + b * sob + h * soh, offs_m, som, sod, offs_d, Tq, D)
    row = bh * Tq + offs_m
    m_i = tl.load(M + row, mask=offs_m < Tq, other=0.0)
    l_i = tl.load(L + row, mask=offs_m < Tq, other=1.0)
    delta = tl.load(Delta + row, mask=offs_m < Tq, other=0.0)
    fill = tl.load(Fill)
    bias_row, pad_row = Bias + h * sbh, Pad + b * spb
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=fill.dtype)
    end = Tk
    if CAUSAL:
        end = tl.minimum(Tk, (block + 1) * BLOCK_M + Tk - Tq)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + h * skh, offs_n, skn, skd, offs_d, Tk, D)
        v = _load_rows(V + b * svb + h * svh, offs_n, svn, svd, offs_d, Tk, D)
        s, blocked = _logits(q, tl.trans(k), offs_m, offs_n, bias_row, pad_row, fill, Tq, Tk,
                             HAS_BIAS, HAS_PADDING, CAUSAL, PRECISION)
        p = tl.exp(s - m_i[:, None]) / l_i[:, None]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(blocked, 0.0, p * (dp - delta[:, None]))
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, dq.to(dQ.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D))


def _strides(*tensors):
    return [stride for x in tensors for stride in x.stride()]


def settings(dtype: torch.dtype, head_dims: int, on_cuda: bool) -> dict:
    """The kernels' compile-time settings for inputs of `dtype` with `head_dims` per head: tiles of 64
    on CUDA (32 for heads over 64 dims), 16 in the interpreter (the smallest tl.dot); float32
    products in IEEE arithmetic, as torch's default matmul (no TF32; the choice applies to float32
    operands only)."""
    head_block = max(16, triton.next_power_of_2(head_dims))
    block = (64 if head_block <= 64 else 32) if on_cuda else 16
    return dict(BLOCK_M=block, BLOCK_N=block, BLOCK_D=head_block,
                PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32")


def forward(q, k, v, bias, padding, causal, fill):
    """(out, m, l): the output (B, H, Tq, D) in q's dtype, each row's maximum and sum (B, H, Tq) in the
    accumulation dtype (float64 for float64 inputs, else float32). `bias` (H, Tq + Tk - 1) or None,
    `padding` (B, Tk) int8 (non-zero: padded) or None, `fill` a one-element tensor of that dtype."""
    batch, heads, queries, dims = q.shape
    keys = k.size(2)
    config = settings(q.dtype, dims, q.is_cuda)
    block = config["BLOCK_M"]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    m = torch.empty(batch, heads, queries, dtype=fill.dtype, device=q.device)
    l = torch.empty_like(m)  # noqa: E741
    bias_arg = bias if bias is not None else fill
    pad_arg = padding if padding is not None else fill
    grid = (triton.cdiv(queries, block), batch * heads)
    _attention_forward[grid](q, k, v, bias_arg, pad_arg, fill, out, m, l, *_strides(q, k, v, out),
                   bias.stride(0) if bias is not None else 0, padding.stride(0) if padding is not None else 0,
                   heads, queries, keys, dims, HAS_BIAS=bias is not None, HAS_PADDING=padding is not None,
                   CAUSAL=causal, **config)
    return out, m, l


def backward(q, k, v, bias, padding, causal, fill, out, m, l, grad_out, bias_grad):  # noqa: E741
    """(dq, dk, dv, dbias): dbias (H, Tq + Tk - 1) in the accumulation dtype where `bias_grad`, else None.
    `grad_out` must share `out`'s strides."""
    batch, heads, queries, dims = q.shape
    keys = k.size(2)
    config = settings(q.dtype, dims, q.is_cuda)
    block = config["BLOCK_M"]
    delta = (grad_out.to(fill.dtype) * out.to(fill.dtype)).sum(-1).contiguous()
    # dq, dk, dv are written with the strides of q, k, v (non-overlapping: triton_bias.py)
    dq, dk, dv = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in (q, k, v))
    bias_arg = bias if bias is not None else fill
    pad_arg = padding if padding is not None else fill
    key_blocks = triton.cdiv(keys, block)
    with_grad = bias is not None and bias_grad
    sums = torch.zeros(batch * heads * key_blocks * (queries + keys - 1) if with_grad else 1,
                       dtype=fill.dtype, device=q.device)
    scratch = torch.zeros(batch * heads * key_blocks * block * 2 * block if with_grad else 1,
                          dtype=fill.dtype, device=q.device)
    common = dict(HAS_BIAS=bias is not None, HAS_PADDING=padding is not None, CAUSAL=causal, **config)
    strides = [*_strides(q, k, v, grad_out), bias.stride(0) if bias is not None else 0,
               padding.stride(0) if padding is not None else 0]
    _attention_backward_keys[(key_blocks, batch * heads)](
        q, k, v, bias_arg, pad_arg, fill, grad_out, m, l, delta, dk, dv, sums, scratch, *strides,
        heads, queries, keys, dims, key_blocks, BIAS_GRAD=with_grad, **common)
    _attention_backward_queries[(triton.cdiv(queries, block), batch * heads)](
        q, k, v, bias_arg, pad_arg, fill, grad_out, m, l, delta, dq, *strides, heads, queries, keys, dims, **common)
    dbias = sums.view(batch, heads, key_blocks, queries + keys - 1).sum((0, 2)) if with_grad else None
    return dq, dk, dv, dbias
