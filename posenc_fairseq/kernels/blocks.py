"""Long inputs whose terms depend on the query (Shaw, LFHC, XL, GCDF): a kernel serves one block
of queries at a time, so that a block's relative terms are all that exist at once (its window of
the call's distances); the result is the same. Under fairseq's future mask a block leaves out the
keys after its last query (all blocked), unless some query sees no key at all (left padding). In
training each block is recomputed during backward (activation checkpointing of the block alone),
so a step keeps only the blocks' inputs, not the probabilities (B, H, n, n) of every layer, at the
price of computing the blocked attention twice."""
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..block_size import BLOCK_ELEMENTS, rows_per_block
from ..encodings.distance import window
from .terms import blocked_entries

#: queries per block when relative terms are computed a block at a time (see `query_block_size`)
QUERY_BLOCK = 128
#: BLOCK_ELEMENTS (the logits of one block, below which a call is not split) times this on the
#: fused CPU training path (biased_cpu.py), which keeps a block's terms but not its logits and
#: probabilities: each block's backward gives full-size gradients of the keys, values and the
#: encoding's distance terms, summed over the blocks, so fewer blocks cost less (docs/benchmarks.md)
FUSED_BLOCK_FACTOR = 4


def query_block_size(batch_heads: int, keys: int, fused: bool = False) -> int:
    """Queries per block for encodings with relative terms (Shaw, LFHC, XL, GCDF): QUERY_BLOCK, or
    more where a block of logits would stay under BLOCK_ELEMENTS (short keys, small batch),
    so that short inputs run in one piece; `fused`: FUSED_BLOCK_FACTOR times as many
    elements."""
    elements = BLOCK_ELEMENTS * (FUSED_BLOCK_FACTOR if fused else 1)
    return rows_per_block(elements, batch_heads * keys, QUERY_BLOCK)


def every_query_sees_a_key(call) -> bool:
    """Whether no query of the `AttentionCall` `call` (under fairseq's future mask, `future_blocked`)
    has all its keys blocked. Such a query weighs every key of the call alike, as the explicit
    softmax of the filled logits does, so its block may not leave out the keys after it. The stack's
    future mask leaves each query the first key: only a padded first key can take it (one host read
    where there is padding); any other mask is read whole."""
    if call.stack_mask:
        return call.key_padding_mask is None or not bool(call.key_padding_mask[:, 0].any())
    blocked = blocked_entries(call)
    return not bool(blocked.all(-1).any())


def attend(call, block: int, recompute: bool, serve: Callable) -> Tensor:
    """The output (B, H, Tq, D) of the `AttentionCall` `call`, `serve(block_call)` of each block of
    `block` queries, concatenated; `recompute`: each block is checkpointed (same dropout mask in
    its recomputation: the RNG state is restored)."""
    q = call.q
    queries, source_keys = q.size(2), call.source_keys
    target_len = call.k.size(2) - source_keys
    first = target_len - queries  # position of the first query
    leave_out_future = call.future_blocked and every_query_sees_a_key(call)
    parts = []
    for start in range(0, queries, block):
        rows = slice(start, min(start + block, queries))
        target_keys = first + rows.stop if leave_out_future else target_len
        keys = source_keys + target_keys
        # the block's distances: its last query to the first key .. its first query to the last key
        low, high = -(first + rows.stop - 1), target_keys - 1 - (first + rows.start)
        block_call = call._replace(
            k_target=call.k_target[:, :, :target_keys],
            term=window(call.term, low, high) if call.term is not None else None,
            values=window(call.values, low, high) if call.values is not None else None,
            attn_mask=call.attn_mask[..., rows, :keys] if call.attn_mask is not None else None,
            key_padding_mask=call.key_padding_mask[:, :keys] if call.key_padding_mask is not None else None)

        def block_output(q_rows, block_call=block_call, keys=keys):
            return serve(block_call._replace(q=q_rows, k=call.k[:, :, :keys], v=call.v[:, :, :keys]))

        if recompute:
            parts.append(checkpoint(call.recorded(block_output), q[:, :, rows], use_reentrant=False))
        else:
            parts.append(block_output(q[:, :, rows]))
    return torch.cat(parts, dim=2)
