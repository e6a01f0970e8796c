"""Which kernel serves one attention call: `plan(AttentionCall) -> Plan`, the one place that decides.

    STEP        a decoding step (one query): its terms as additions to q, k, v and the logits
                (`distance.step_terms`), SDPA of the changed inputs (step.py)
    TRITON      one Triton kernel reading the per-distance terms inside, with their gradients
                (triton_attention.py; POSENC_TRITON_ATTENTION: by default on CUDA for the terms that
                depend on the query)
    FLEX        FlexAttention, the encoding's per-distance terms read inside the kernel (flex.py)
    LOGITS      the caller asked for the logits before softmax (explicit.py)
    EXPLICIT    the softmax written out: attention weights asked for, a relative value term, or
                query-dependent terms with a gradient where SDPA has no fused kernel for them (CPU)
                (explicit.py)
    SDPA        PyTorch's fused attention, the dense terms as its float mask (sdpa.py); told
                `is_causal` where fairseq's future mask is all there is to add
    BIASED_CPU  CPU float32 training: SDPA's fused CPU kernel forward and a blockwise backward of
                our own, for terms that need a gradient (biased_cpu.py)

Where the terms depend on the query (a (B, H, Tq, .) product per call: Shaw, LFHC, XL, GCDF) and
the call is long, the plan runs the kernel one block of queries at a time (blocks.py).

`plan` is a pure function of the call: everything it reads is a field of the `AttentionCall`
(the grad mode, whether a checkpointed function is running, the FlexAttention and Triton switches) or follows
from its tensors (whether the terms need a gradient, `terms_need_gradient`). The kernels receive
the call and never the encoding: what they need of it (`memoize`, `recorded`) are fields.
"""
import enum
from typing import Any, Callable, NamedTuple, Optional

from torch import Tensor

from ..encodings.distance import DistanceTerm
from . import biased_cpu, blocks, flex, sdpa, triton_attention
from .masks import is_future_mask


class AttentionCall(NamedTuple):
    """One call of PositionalAttention after projection, scaling and the incremental cache.

    `q` (B, H, Tq, D) scaled by 1/sqrt(D); `k`, `v` (B, H, Tk, D): under --cross-self-attention the
    `source_keys` source tokens first, then the target keys `k_target`; the queries are the last
    Tq of the target keys. `term`, `values`: the encoding's logit and value terms of the call
    (`DistanceTerm`s over its key - query distances, the kept heads only), None where there are
    none. `future_blocked`: the mask is fairseq's future mask. `logits`: B * H * Tq * Tk of the
    whole call (a block keeps its call's). `stack_mask`: `attn_mask` is (a slice of) the mask the
    decoder stack made in this pass, fairseq's future mask (only 0 and -inf). `grad_enabled`: torch's grad mode at the call;
    `recorded_run`: a checkpointed function (a layer, a block) is running, whose recomputation
    covers this call; `flex_mode`: POSENC_FLEX_ATTENTION of the pass (flex.py); `triton_mode`:
    POSENC_TRITON_ATTENTION of the pass (triton_attention.py). `memoize(key,
    compute)`: the encoding's pass-scope memo (dense bias-only terms shared by the layers);
    `recorded(function)`: `function` for non-reentrant checkpointing (cache.py); both None
    without an encoding."""
    q: Tensor
    k: Tensor
    v: Tensor
    k_target: Tensor
    attn_mask: Optional[Tensor]
    key_padding_mask: Optional[Tensor]
    source_keys: int
    need_weights: bool
    before_softmax: bool
    term: Optional[DistanceTerm]
    values: Optional[DistanceTerm]
    future_blocked: bool
    dropout_p: float
    logits: int
    grad_enabled: bool
    stack_mask: bool = False
    recorded_run: bool = False
    flex_mode: str = "off"
    triton_mode: str = "off"
    memoize: Optional[Callable[[Any, Callable[[], Any]], Any]] = None
    recorded: Optional[Callable[[Callable], Callable]] = None

    @property
    def relative(self) -> bool:
        """Whether the encoding adds relative terms to this call."""
        return self.term is not None or self.values is not None


class Kernel(enum.Enum):
    STEP = "step"
    TRITON = "triton"
    FLEX = "flex"
    LOGITS = "logits"
    EXPLICIT = "explicit"
    SDPA = "sdpa"
    BIASED_CPU = "biased_cpu"


class Plan(NamedTuple):
    """`kernel` serves the call (or each block of `query_block` queries; None: one piece),
    `recompute_blocks`: each block is recomputed in backward (checkpointed), `fold_content`: the
    encoding's `content_query` may be added to the queries of the product with the keys, `causal`:
    SDPA is told the mask is causal (`is_causal`) instead of given it (on CUDA: the flash kernel)."""
    kernel: Kernel
    query_block: Optional[int] = None
    recompute_blocks: bool = False
    fold_content: bool = False
    causal: bool = False


#: what one call's query blocks under the future mask may keep of their terms for backward on the fused CPU
#: path (half the call's pairs) rather than recompute them: beyond it memory would grow as T^2 per layer
KEEP_TERMS_BYTES = 64 * 2 ** 20

#: the plans of whole calls (no query blocks): immutable values, made once rather than per call
_WHOLE_CALL = {(kernel, fold): Plan(kernel, fold_content=fold) for kernel in Kernel for fold in (False, True)}
_CAUSAL_SDPA = Plan(Kernel.SDPA, causal=True)


def plan(call: AttentionCall) -> Plan:
    """Which kernel serves `call`, in query blocks or not."""
    if (call.relative and call.q.size(2) == 1 and not call.source_keys
            and not (call.need_weights or call.before_softmax)):
        return _WHOLE_CALL[Kernel.STEP, False]
    # terms that depend on the query ((B, H, Tq, .) per call: Shaw, LFHC, XL, GCDF)
    query_dependent = call.values is not None or (call.term is not None and call.term.vectors is not None)
    if (call.relative and triton_attention.available(call.q, call.triton_mode, query_dependent)
            and triton_attention.serves(call)):
        return _WHOLE_CALL[Kernel.TRITON, False]
    if call.relative and _flex_serves(call):
        kernel = Kernel.FLEX
    elif call.before_softmax:
        kernel = Kernel.LOGITS
    elif call.need_weights or call.values is not None:
        kernel = Kernel.EXPLICIT
    else:
        kernel = Kernel.SDPA
    if kernel is Kernel.SDPA and _only_causal(call):
        return _CAUSAL_SDPA
    # XL/GCDF's u.k_j: folded into the product with the keys, (q + u).k_j, where every key carries
    # the relative terms (one (B, H, Tq, Tk) addition fewer)
    fold_content = (call.term is not None and call.term.content is not None and not call.source_keys
                    and kernel is not Kernel.FLEX)
    if kernel is Kernel.SDPA and terms_need_gradient(call, fold_content):
        if biased_cpu.serves_call(call.q, call.dropout_p, call.logits, call.grad_enabled):
            kernel = Kernel.BIASED_CPU
        elif query_dependent and not sdpa.fused_mask_gradient(call.q):
            kernel = Kernel.EXPLICIT  # SDPA's unfused fallback for a mask with gradient keeps more memory
    if not query_dependent:  # (else computed a block of queries at a time)
        return _WHOLE_CALL[kernel, fold_content]
    # whether the blocks' terms (if they need a gradient) take the fused CPU kernel
    fused_cpu = call.values is None and biased_cpu.serves_call(call.q, call.dropout_p, call.logits, call.grad_enabled)
    batch, heads, queries, _ = call.q.shape
    block = blocks.query_block_size(batch * heads, call.k.size(2), fused=fused_cpu)
    query_block = None
    recompute = False
    if not (call.need_weights or call.before_softmax) and queries > block:
        query_block = block
        # The fused CPU kernel keeps a block's output, log-sum-exp and terms only (not its logits
        # and probabilities). Under the future mask those terms cover the keys up to the block's
        # last query, half of all pairs: such blocks are not recomputed, unless those halves of the
        # call would pass KEEP_TERMS_BYTES (docs/benchmarks.md). Inside a checkpointed layer the
        # layer's checkpoint covers the blocks.
        kept = batch * heads * queries * call.k.size(2) // 2 * call.q.element_size()
        recompute = call.grad_enabled and not call.recorded_run and not (
            call.future_blocked and fused_cpu and kept <= KEEP_TERMS_BYTES)
    return Plan(kernel, query_block, recompute, fold_content)


def terms_need_gradient(call: AttentionCall, content_folded: bool) -> bool:
    """Whether the dense logit term of `call` (`terms.position_terms`) will need a gradient: grad
    mode on and one of the tensors it is computed from needs one (the bias; the queries, shift
    and vectors of the query-dependent part; the keys and content vector of content.k_j unless
    `content_folded`)."""
    term = call.term
    if not call.grad_enabled or term is None:
        return False
    needs = [term.bias]
    if term.vectors is not None:
        needs += [call.q, term.shift, term.vectors]
    if term.content is not None and not content_folded:
        needs += [call.k_target, term.content]
    return any(tensor is not None and tensor.requires_grad for tensor in needs)


def _only_causal(call: AttentionCall) -> bool:
    """Whether all that is added to the call's logits is fairseq's future mask over a square of
    queries and keys: no padding, no position terms. The stack's own mask is known without reading
    it; any other (a checkpointed layer's recomputation, a user's mask) is read."""
    return (call.term is None and call.values is None and call.key_padding_mask is None and not call.source_keys
            and call.q.size(2) == call.k.size(2) and is_future_mask(call.attn_mask, call.stack_mask))


def _flex_serves(call: AttentionCall) -> bool:
    """Whether FlexAttention serves the call (flex.py): the caller asked for neither weights nor
    logits, FlexAttention is on for the device, and nothing needs the explicit path: no relative
    value term, attention dropout or --cross-self-attention keys, and a 2-D attn_mask (fairseq's)."""
    return (not (call.need_weights or call.before_softmax) and call.term is not None and call.values is None
            and flex.available(call.q, call.flex_mode, call.grad_enabled) and call.dropout_p == 0.0
            and not call.source_keys
            and (call.attn_mask is None or call.attn_mask.dim() == 2))
