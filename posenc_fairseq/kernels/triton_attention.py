"""The TRITON path: one fused attention kernel (triton_kernels.py) that reads the position term per
key - query distance inside, forward and backward, with O(n) memory and deterministic fp32 gradients
of the term's tables.

It serves every encoding's relative terms (`DistanceTerm`s):
    T5, T5-NoB, AT5, AT5-NoB, ALiBi   a bias per distance (T5: its bucket table spread over the
                                      distances by `take_runs`; the gradient flows back through it)
    Shaw, LFHC                        q . a^K_r per distance and the value term sum_j p_ij a^V_r (the
                                      table rows spread over the distances)
    XL, GCDF                          (q + v) . W_r R per distance, and u . k_j (added to the queries
                                      of the product with the keys)
Attention dropout is applied inside, its mask drawn per (query, key) from a seed (`TritonAttention`).
Not served, taking the other paths: attention weights or logits asked for, --cross-self-attention,
masks other than key padding and fairseq's future mask, and dropout over 2^32 (query, key) pairs per
head (the draws' counter is 32 bits).

Where it is used: the environment variable POSENC_TRITON_ATTENTION, read when a stack starts a forward
pass (`mode()`; its value travels in the pass context and the `AttentionCall`):
    "auto" (default)  on CUDA (compute capability 8.0 or later, `triton` importable; fp32, fp16, bf16),
                      the calls whose terms depend on the query: Shaw, LFHC, XL, GCDF. Their other paths build the terms
                      per block of queries and recompute the blocks in backward, and the kernel trained
                      them faster on a GPU (docs/benchmarks.md). The bias-only encodings (T5, T5-NoB,
                      AT5, AT5-NoB, ALiBi) keep SDPA's fused kernels with a dense bias, measured as fast
                      or faster there.
    "on"              on CUDA, every call it serves, in training and inference; on CPU the other paths
                      serve, except where Triton's interpreter is on (TRITON_INTERPRET=1: the exactness
                      tests), for which `mode()` gives "interpreted"; without the `triton` package it is
                      refused with that message
    "off"             never
Its exactness is tested in the interpreter and, with `make test-cuda`, on a GPU (tests/kernels/
test_triton_attention.py); scripts/gpu_check.py --only t compares it with the other paths on a GPU.

A row that sees no key (all its keys padded) gets what the explicit path gives it, uniform weights
over all Tk keys (dropped as any other): its block of queries skips no tile (`sentence_keys`).
"""
import importlib
import importlib.util
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings.distance import varying_columns, vectors_per_column, window
from ..encodings.positions import take_runs
from ..switches import INTERPRETED, TRITON_ATTENTION, TRITON_ATTENTION_MODES, triton_attention_mode
from .masks import is_future_mask

#: the switch (switches.py): its variable, values, reader (`mode()`, read when a stack starts a pass)
SWITCH, MODES, mode = TRITON_ATTENTION, TRITON_ATTENTION_MODES, triton_attention_mode


def available(q: Tensor, triton_mode: str, query_dependent: bool) -> bool:
    """Whether `triton_mode` (`mode()` of the pass) lets the queries `q` take the kernel on their
    device; "auto" only for terms that depend on the query (`query_dependent`), in the dtypes and on
    the GPUs it ran or was compiled for."""
    if triton_mode == INTERPRETED:
        return True
    if not q.is_cuda or triton_mode == "off":
        return False
    return triton_mode == "on" or (query_dependent and q.dtype in AUTO_DTYPES and auto_capable(q.device))


#: the dtypes "auto" takes the kernel in (float64 has never run compiled)
AUTO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: the compute capability from which "auto" uses the kernel (tested on sm_80 and sm_90 builds)
AUTO_CAPABILITY = (8, 0)


#: whether the `triton` package is installed (without it "auto" takes the other paths)
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def auto_capable(device: torch.device) -> bool:
    """Whether "auto" takes the kernel on `device`: compute capability AUTO_CAPABILITY or later (torch
    keeps each device's properties) and `triton` installed (else the other paths serve, as with "off")."""
    return TRITON_INSTALLED and torch.cuda.get_device_capability(device) >= AUTO_CAPABILITY


def _kernels():
    try:
        return importlib.import_module(__package__ + ".triton_kernels")
    except ImportError as error:
        raise RuntimeError(f"{SWITCH}=on needs the `triton` package ({error}); unset {SWITCH} (its default, "
                           "auto, takes the other paths without it) or set it to off") from error


#: dropout draws one Philox number per (query, key) of a head at the 32-bit counter i Tk + j
DROPOUT_PAIRS = 2 ** 32


def serves(call) -> bool:
    """Whether the kernel serves the `AttentionCall` `call`: relative terms, neither weights nor
    logits asked for, no source keys, dropout (if any) over fewer than DROPOUT_PAIRS pairs, and no mask
    but key padding and fairseq's future mask over a square (the stack's, known unread; any other is
    read, so that a checkpointed layer's recomputation takes the kernel its first run took)."""
    if not call.relative:
        return False
    if call.need_weights or call.before_softmax or call.source_keys:
        return False
    if call.dropout_p > 0 and call.q.size(2) * call.k.size(2) >= DROPOUT_PAIRS:
        return False
    if call.attn_mask is None:
        return True
    return call.future_blocked and is_future_mask(call.attn_mask, call.stack_mask)


def attend(call) -> Tensor:
    """softmax(q k^T + term + masks) v of `call` (served: `serves`), (B, H, Tq, D). The tables go to the
    kernel for the columns where the terms' rows vary (`varying_columns`), their first and last rows
    standing for the clipped ends."""
    term, values, first = call.term, call.values, 0
    ranges = [varying_columns(x) for x in (term, values) if x is not None]
    if ranges:
        first, last = min(low for low, _ in ranges), max(high for _, high in ranges)
        term, values = (window(x, x.low + first, x.low + last) if x is not None else None for x in (term, values))
    bias = vectors = query_for_vectors = None
    query = call.q
    if term is not None:
        if term.bias is not None:
            bias = term.bias if term.rows is None else take_runs(term.bias, term.rows)
        if term.vectors is not None:
            vectors = vectors_per_column(term)
            # (in the queries' dtype: under autocast the encoding's vectors may be float32)
            query_for_vectors = call.q if term.shift is None else (call.q + term.shift).to(call.q.dtype)
        if term.content is not None:
            query = (call.q + term.content).to(call.q.dtype)
    values = vectors_per_column(values) if values is not None else None
    return TritonAttention.apply(query, query_for_vectors, call.k, call.v, bias, vectors, values,
                                 call.key_padding_mask, call.attn_mask is not None, call.dropout_p, first)


def _non_overlapping(x: Tensor) -> Tensor:
    """`x` itself where its gradient can be written with its strides (contiguous, or fairseq's
    (B, T, H, D) layout seen as (B, H, T, D)), else a contiguous copy."""
    return x if x.is_contiguous() or x.transpose(1, 2).is_contiguous() else x.contiguous()


class TritonAttention(torch.autograd.Function):
    """dropout(softmax_j(q k^T + bias[h, r] + qr . vectors[h, r] + masks)) (v_j + values[h, r]),
    r = min(max(c - first_column, 0), R - 1), c = j - i + Tq - 1, the queries already scaled (and
    shifted by the caller). `qr` (B, H, Tq, D) or None (no vectors); the tables, R rows for the columns
    first_column .. first_column + R - 1 of the N = Tq + Tk - 1 (their first and last rows stand for the
    columns before and after), or None: `bias` (H, R), `vectors` and `values` (H or 1, R, D); `padding`
    (B, Tk) True at padded keys, or None; `causal`: key j after query
    i + Tk - Tq blocked; `dropout_p`: attention dropout's probability, its mask drawn inside the kernels
    from a seed that torch's generator of q's device gives (so a checkpointed recomputation, which
    restores that generator, draws the same)."""

    @staticmethod
    def forward(ctx, q: Tensor, qr: Optional[Tensor], k: Tensor, v: Tensor, bias: Optional[Tensor],
                vectors: Optional[Tensor], values: Optional[Tensor], padding: Optional[Tensor], causal: bool,
                dropout_p: float = 0.0, first_column: int = 0):
        kernels = _kernels()
        q, k, v = (_non_overlapping(x) for x in (q, k, v))
        if qr is not None:
            qr = _non_overlapping(qr)
            if qr.stride() != q.stride():  # (the kernels read both with one set of strides)
                q, qr = q.contiguous(), qr.contiguous()
        accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
        fill = torch.full((1,), torch.finfo(q.dtype).min, dtype=accumulate, device=q.device)
        keys = None
        if padding is not None:
            padding = padding.to(torch.int8).contiguous()
            keys = kernels.sentence_keys(padding, q.size(2), causal)
        seed = torch.randint(2 ** 62, (1,), device=q.device) if dropout_p > 0 else None
        bias, vectors, values = (x.contiguous() if x is not None else None for x in (bias, vectors, values))
        inputs = kernels.Inputs(q, qr, k, v, bias, vectors, values, padding, keys, causal, fill, dropout_p, seed,
                                first_column)
        out, m, l = kernels.forward(inputs)  # noqa: E741
        ctx.save_for_backward(q, qr, k, v, bias, vectors, values, padding, keys, fill, seed, out, m, l)
        ctx.causal, ctx.dropout_p, ctx.first_column = causal, dropout_p, first_column
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, qr, k, v, bias, vectors, values, padding, keys, fill, seed, out, m, l = ctx.saved_tensors  # noqa: E741
        kernels = _kernels()
        inputs = kernels.Inputs(q, qr, k, v, bias, vectors, values, padding, keys, ctx.causal, fill, ctx.dropout_p,
                                seed, ctx.first_column)
        dq, dqr, dk, dv, *tables = kernels.backward(inputs, out, m, l, grad_out.contiguous(),
                                                    ctx.needs_input_grad[4:7])
        dbias, dvectors, dvalues = (grad.to(table.dtype) if grad is not None else None
                                    for grad, table in zip(tables, (bias, vectors, values)))
        return dq, dqr, dk, dv, dbias, dvectors, dvalues, None, None, None, None
