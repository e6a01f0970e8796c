"""Which kernel serves one attention call: `plan(AttentionCall) -> Plan`, the one place that decides.

    STEP        a decoding step whose encoding gives its terms as additions to q, k, v and the
                logits (`StepTerms`): SDPA of the changed inputs (step.py)
    FLEX        FlexAttention, the encoding's per-distance terms read inside the kernel (flex.py)
    LOGITS      the caller asked for the logits before softmax (explicit.py)
    EXPLICIT    the softmax written out: attention weights asked for, a relative value term, or
                terms with a gradient that no fused kernel serves well (explicit.py)
    SDPA        PyTorch's fused attention, the dense terms as its float mask (sdpa.py)
    BIASED_CPU  CPU float32 training: SDPA's fused CPU kernel forward and a blockwise backward of
                our own, for terms that need a gradient (biased_cpu.py)

Where an encoding computes its relative terms a block of queries at a time (`query_blocks`) and
the call is long, the plan runs the kernel one block at a time (blocks.py).

One fact is known only once the dense terms exist: whether they need a gradient. It moves an
SDPA plan to BIASED_CPU, or to EXPLICIT for the blockwise encodings (`Plan.kernel_for`).
"""
import enum
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..encodings.base import PositionalEncoding, StepTerms
from ..encodings.positions import Positions
from . import biased_cpu, blocks, flex


class AttentionCall(NamedTuple):
    """One call of PositionalAttention after projection, scaling and the incremental cache.

    `q` (B, H, Tq, D) scaled by 1/sqrt(D); `k`, `v` (B, H, Tk, D): under --cross-self-attention the
    `source_keys` source tokens first, then the target keys `k_target`. `query_positions` and
    `key_positions` (`position_range`s) number the queries and target keys, the queries being the
    last Tq of them (None where not `relative`). `relative`: the encoding's relative hooks apply
    (self-attention with an encoding that has such hooks); `logit_terms`: ... and the encoding
    adds logit terms. `future_blocked`: the mask is fairseq's future mask (checked). `logits`:
    B * H * Tq * Tk of the whole call (a block keeps its call's)."""
    q: Tensor
    k: Tensor
    v: Tensor
    k_target: Tensor
    attn_mask: Optional[Tensor]
    key_padding_mask: Optional[Tensor]
    query_positions: Optional[Positions]
    key_positions: Optional[Positions]
    source_keys: int
    need_weights: bool
    before_softmax: bool
    encoding: Optional[PositionalEncoding]
    role: Optional[str]
    layer: Optional[int]
    relative: bool
    logit_terms: bool
    value_term: bool
    future_blocked: bool
    step_terms: Optional[StepTerms]
    kept_heads: Optional[Tensor]
    full_heads: int
    dropout_p: float
    logits: int


class Kernel(enum.Enum):
    STEP = "step"
    FLEX = "flex"
    LOGITS = "logits"
    EXPLICIT = "explicit"
    SDPA = "sdpa"
    BIASED_CPU = "biased_cpu"


class Plan(NamedTuple):
    """`kernel` serves the call (or each block of `query_block` queries; None: one piece),
    `recompute_blocks`: each block is recomputed in backward (checkpointed), `fold_content`: the
    encoding's `content_query` may be added to the queries of the product with the keys,
    `explicit_for_gradient`: terms that need a gradient and that BIASED_CPU does not serve take
    EXPLICIT rather than SDPA."""
    kernel: Kernel
    query_block: Optional[int] = None
    recompute_blocks: bool = False
    fold_content: bool = False
    explicit_for_gradient: bool = False

    def kernel_for(self, call: AttentionCall, terms: Optional[Tensor]) -> Kernel:
        """The kernel of `call` (the whole call or one block) whose dense terms are `terms`."""
        if self.kernel is not Kernel.SDPA or terms is None:
            return self.kernel
        if biased_cpu.applies(call.q, terms, call.dropout_p, call.logits):
            return Kernel.BIASED_CPU
        if self.explicit_for_gradient and terms is not None and terms.requires_grad:
            # SDPA's unfused fallback for a mask with gradient keeps more memory than the explicit softmax
            return Kernel.EXPLICIT
        return Kernel.SDPA


#: the plans of whole calls (no query blocks): immutable values, made once rather than per call
_WHOLE_CALL = {(kernel, fold): Plan(kernel, fold_content=fold) for kernel in Kernel for fold in (False, True)}


def plan(call: AttentionCall) -> Plan:
    """Which kernel serves `call`, in query blocks or not."""
    if call.step_terms is not None:
        return _WHOLE_CALL[Kernel.STEP, False]
    if call.relative and _flex_serves(call):
        kernel = Kernel.FLEX
    elif call.before_softmax:
        kernel = Kernel.LOGITS
    elif call.need_weights or call.value_term:
        kernel = Kernel.EXPLICIT
    else:
        kernel = Kernel.SDPA
    # XL/GCDF's u.k_j: folded into the product with the keys, (q + u).k_j, where every key carries
    # the relative terms and no head is pruned (one (B, H, Tq, Tk) addition fewer)
    fold_content = (call.relative and not call.source_keys and call.kept_heads is None
                    and kernel is not Kernel.FLEX)
    blockwise = call.relative and getattr(call.encoding, "query_blocks", False)
    if not blockwise:
        return _WHOLE_CALL[kernel, fold_content]
    # whether the blocks' terms (if they need a gradient) take the fused CPU kernel
    fused_cpu = not call.value_term and biased_cpu.serves_call(call.q, call.dropout_p, call.logits)
    batch, heads, queries, _ = call.q.shape
    block = blocks.query_block_size(batch * heads, call.k.size(2), fused=fused_cpu)
    query_block = None
    recompute = False
    if not (call.need_weights or call.before_softmax) and queries > block:
        query_block = block
        # The fused CPU kernel keeps a block's output, log-sum-exp and terms only (not its logits
        # and probabilities). Under the future mask those terms cover the keys up to the block's
        # last query, half of all pairs: such blocks are not recomputed (docs/benchmarks.md).
        # Inside a checkpointed layer the layer's checkpoint covers the blocks.
        recompute = (torch.is_grad_enabled() and not call.encoding.in_recorded_run()
                     and not (call.future_blocked and fused_cpu))
    return Plan(kernel, query_block, recompute, fold_content, explicit_for_gradient=True)


def _flex_serves(call: AttentionCall) -> bool:
    """Whether FlexAttention serves the call (flex.py): the caller asked for neither weights nor
    logits, FlexAttention is on for the device, the encoding gives its terms per distance, and
    nothing needs the explicit path: no relative value term, attention dropout, head pruning or
    --cross-self-attention keys, and a 2-D attn_mask (fairseq's)."""
    return (not (call.need_weights or call.before_softmax) and call.relative and flex.supports(call.encoding)
            and flex.available(call.q) and not call.value_term and call.dropout_p == 0.0
            and call.kept_heads is None and not call.source_keys
            and (call.attn_mask is None or call.attn_mask.dim() == 2))
