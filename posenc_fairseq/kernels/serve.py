"""Runs a `Plan`: the kernel it names serves the call, whole or one block of queries at a time."""
from typing import Callable, Optional, Tuple

from torch import Tensor

from ..encodings.distance import flex_table
from . import biased_cpu, blocks, explicit, flex, sdpa, step, triton_attention
from .masks import blocked_fill_value
from .plan import AttentionCall, Kernel, Plan
from .subnormals import flush_subnormals_in_backward
from .terms import masked_logits, position_terms, with_finite_mask, with_masks


def serve(call: AttentionCall, plan: Plan, dropout: Callable[[Tensor], Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The output (B, H, Tq, D) of `call` and its probabilities where they are computed (EXPLICIT,
    whole calls); LOGITS: the logits (B, H, Tq, Tk) instead. `dropout`: the attention's dropout
    module (EXPLICIT applies it to the probabilities)."""
    if plan.kernel is Kernel.STEP:
        return step.attend(call), None
    if plan.kernel is Kernel.TRITON:
        return triton_attention.attend(call), None
    content_query = call.term.content if plan.fold_content else None
    if plan.query_block is None:
        return _serve_piece(call, plan, content_query, dropout)
    return blocks.attend(call, plan.query_block, plan.recompute_blocks,
                         lambda piece: _serve_piece(piece, plan, content_query, dropout)[0]), None


def _serve_piece(call: AttentionCall, plan: Plan, content_query: Optional[Tensor],
                 dropout: Callable[[Tensor], Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """One piece (the whole call or one block of queries)."""
    if plan.kernel is Kernel.FLEX:
        return flex.attend(call.q, call.k, call.v, flex_table(call.term, call.q, call.k), call.attn_mask,
                           call.key_padding_mask, blocked_fill_value(call.q.dtype)), None
    terms = position_terms(call, content_folded=content_query is not None)
    q = call.q if content_query is None else call.q + content_query
    kernel = plan.kernel
    if kernel is Kernel.LOGITS:
        # (in the model's dtype, as fairseq's before_softmax gives them)
        return masked_logits(call, explicit.logits(q, call.k, with_finite_mask(call, terms)).to(q.dtype)), None
    if kernel is Kernel.EXPLICIT:  # (fills the blocked logits itself)
        return explicit.attend(call, q, with_finite_mask(call, terms), dropout)
    if plan.causal:
        return sdpa.attend(q, call.k, call.v, None, call.dropout_p, causal=True), None
    masked = call.attn_mask is not None or call.key_padding_mask is not None
    if kernel is Kernel.BIASED_CPU:  # (it finds the rows that see no key by their log-sum-exp)
        out = biased_cpu.attend(q, call.k, call.v, with_masks(call, terms) if masked else terms, call.future_blocked)
    else:
        out = sdpa.attend_masked(call, q, call.k, call.v, terms)
    if call.term is not None and terms is not None:
        flush_subnormals_in_backward(out, out)
    return out, None
