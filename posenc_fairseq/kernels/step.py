"""A decoding step (one query): its relative terms depend on the key alone, so the logit term is
one row per distance for this query, `step_logits`, read by each key through its row; the value
term mixes the rows by the probabilities summed per row (`dense_values`). Neither adds anything to
the cached keys or values, so a step's cost grows with the distinct rows, not with the cache."""
from typing import Callable

from torch import Tensor

from ..encodings.distance import step_logits
from . import explicit, sdpa
from .terms import with_finite_mask, with_masks


def attend(call, dropout: Callable[[Tensor], Tensor]) -> Tensor:
    """The output (B, H, 1, D) of the `AttentionCall` `call`, one query; `dropout`: the attention's
    dropout module (for a value term, whose probabilities are written out)."""
    q, term = call.q, call.term
    additive = None
    if term is not None:
        additive = step_logits(term, q).to(q.dtype)
        if term.content is not None:  # content.k_j, as (q + content).k_j
            q = q + term.content.to(q.dtype)
    additive = with_finite_mask(call, additive)
    masked = call.attn_mask is not None or call.key_padding_mask is not None
    if call.values is not None or ((additive is not None or masked) and q.device.type == "cpu"
                                   and call.dropout_p == 0.0):
        # the value term needs the probabilities; on CPU, one query with an additive term or a mask
        # costs less written out than SDPA's kernel with a float mask (docs/benchmarks.md)
        return explicit.attend(call, q, additive, dropout)[0]
    return sdpa.attend(q, call.k, call.v, with_masks(call, additive) if masked else additive, call.dropout_p)
