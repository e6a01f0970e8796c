"""A decoding step (one query) of an encoding with `step_terms` (Shaw, LFHC, XL, GCDF in inference):
its relative terms depend on the key alone, so they are additions to the query, keys, values and
logits (`StepTerms`), and the step is plain fused attention (SDPA) of the changed inputs."""
from torch import Tensor

from . import sdpa
from .terms import with_masks


def attend(call) -> Tensor:
    """The output (B, H, 1, D) of the `AttentionCall` `call` with its `step_terms`."""
    step_terms, q, k, v = call.step_terms, call.q, call.k, call.v
    if step_terms.query is not None:
        q = q + step_terms.query.to(q.dtype)
    if step_terms.keys is not None:
        k = k + step_terms.keys.to(k.dtype)
    if step_terms.values is not None:
        v = v + step_terms.values.to(v.dtype)
    additive = None
    if call.attn_mask is not None or call.key_padding_mask is not None:
        additive = with_masks(call, None)
    if step_terms.logits is not None:
        logits = step_terms.logits.to(q.dtype)
        additive = logits if additive is None else additive + logits
    return sdpa.attend(q, k, v, additive, call.dropout_p)
