"""A decoding step (one query): its relative terms depend on the key alone, so they are additions
to the query, keys, values and logits (`distance.step_terms`), and the step is plain fused
attention (SDPA) of the changed inputs."""
from torch import Tensor

from ..encodings.distance import step_terms
from . import sdpa
from .explicit import logits, softmax
from .terms import masked_logits, with_finite_mask


def attend(call) -> Tensor:
    """The output (B, H, 1, D) of the `AttentionCall` `call`, one query."""
    terms, q, k, v = step_terms(call.term, call.values), call.q, call.k, call.v
    if terms.query is not None:
        q = q + terms.query.to(q.dtype)
    if terms.keys is not None:
        k = k + terms.keys.to(k.dtype)
    if terms.values is not None:
        v = v + terms.values.to(v.dtype)
    term_logits = terms.logits.to(q.dtype) if terms.logits is not None else None
    masked = call.attn_mask is not None or call.key_padding_mask is not None
    if (term_logits is not None or masked) and q.device.type == "cpu" and call.dropout_p == 0.0:
        # one query with an additive term or a mask: SDPA's CPU kernel with a float mask costs more
        # than the softmax written out (docs/benchmarks.md)
        return softmax(masked_logits(call, logits(q, k, with_finite_mask(call, term_logits)))).to(v.dtype) @ v
    return sdpa.attend_masked(call, q, k, v, term_logits)  # (it adds the mask's finite part once)
