"""The one attention module every encoding plugs into.

`PositionalAttention` is fairseq's `MultiheadAttention` (same parameters, names, initialisation,
incremental-state layout and beam handling) with a forward that asks a bound
`PositionalEncoding` for optional terms (see `encodings/base.py`):

    projection_bias     per-token bias of the q/k/v projections              (FLOATER)
    project(q|k|v)      position-dependent change of the projected q/k/v    (rotary)
    logit_bias          (heads, q_len, k_len) added to the scaled logits     (T5, AT5, ALiBi)
    relative_logits     query against relative embeddings, (B, H, q, k)      (Shaw, LFHC, XL, GCDF)
    relative_values     probabilities mixed into relative value embeddings   (Shaw, LFHC)
    step_terms          one query's terms as additions to q, k, v and logits (Shaw, LFHC, XL, GCDF)

A decoding step (one query) of an encoding with `step_terms` is plain fused attention of the
changed inputs: its relative terms depend on the key alone there.

Positions are explicit: in self-attention the queries are the last `q_len` of the `k_len` keys
(the cache holds the earlier ones), so query i has position k_len - q_len + i during step-by-step
decoding exactly as in the full forward pass. The positions are `position_range`s: built from
Python integers, so the encodings read their bounds without a device synchronisation.

Long inputs (Shaw, LFHC, XL, GCDF: encodings with `query_blocks`): the hooks are called and the
softmax is taken one block of queries at a time (`QUERY_BLOCK`, `query_block_size`), so a block's
relative terms and distances are all that exist at once; the result is the same. Position terms
that need a gradient take, on CPU in float32, SDPA's fused kernel forward with a blockwise backward
of their own (`biased_attention.py`: SDPA itself has no fused gradient for its mask); elsewhere the
explicit softmax (SDPA's unfused fallback for such a mask keeps more memory). In training each block is recomputed during backward (activation
checkpointing of the block alone), so a step keeps only the blocks' inputs, not the probabilities
(B, H, n, n) of every layer: memory stays near stock's fused attention at the price of computing
the blocked attention twice. Under fairseq's future mask (`blocks_future`) a block leaves out the
keys after its last query and the encodings may skip the distances the mask blocks.

CPU training: the backward of attention with position terms runs with subnormal floats flushed to
zero (`flush_subnormals_in_backward`), which wide-range biases otherwise make several times slower.

fairseq features handled here (see README, "Works with"):
- `--cross-self-attention`: the decoder self-attention keys are cat(source, target). The projection
  hooks (rotary, FLOATER) see the key positions cat(source positions, target positions); the
  relative hooks (logit_bias, relative_logits, relative_values) are given the target keys only and
  add nothing on the source keys, exactly as they add nothing on cross-attention.
- head pruning (`_adaptive_prune_heads`): the module remembers which of the original heads it keeps
  (`kept_heads`, saved with the model) and each kept head keeps its own per-head position terms.
- `--retain-dropout`: attention dropout follows the dropout module's own decision
  (`FairseqDropout.apply_during_inference`) on both paths.
- TorchScript: refused with one message (`__prepare_scriptable__`), see TORCHSCRIPT_MESSAGE.
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from fairseq.modules import MultiheadAttention

from .encodings.base import PositionalEncoding, StepTerms
from . import biased_attention as biased
from . import flex_attention as flex
from .encodings.positions import position_range


def use_positional_attention(module: torch.nn.Module):
    """Turn every fairseq MultiheadAttention inside `module` into a PositionalAttention in place.

    The class swap keeps parameters, buffers and the stock initialisation untouched, so a model
    built this way starts from exactly the weights stock fairseq would give it.
    """
    for submodule in module.modules():
        if type(submodule) is MultiheadAttention:
            submodule.__class__ = PositionalAttention
            submodule.position_binding = None


class PositionBinding:
    """Which encoding an attention module asks, in which role ('encoder', 'decoder', 'cross')
    and at which layer (0-based). Not a Module: the encoding's parameters are owned once, by the model."""

    def __init__(self, encoding, role: str, layer: int):
        self.encoding, self.role, self.layer = encoding, role, layer


TORCHSCRIPT_MESSAGE = (
    "posenc_fairseq models cannot be compiled with TorchScript (torch.jit.script): the positional "
    "encoding is one Python module shared by every layer that keeps per-forward state (the token "
    "positions each stack announces, position terms memoized across layers, FLOATER's ODE table with its "
    "Python solver), which TorchScript cannot represent (torch.jit.trace neither). Run the model in eager "
    "mode (fairseq-generate, fairseq-interactive, hub interfaces) or with torch.compile; see README, "
    "'Works with'.")


def blocked_fill_value(dtype: torch.dtype) -> float:
    """Finite 'minus infinity' for masks: exp() of it underflows to 0 in softmax, and unlike -inf
    a fully masked row gives uniform weights instead of NaN, in fp16/bf16 as in fp32."""
    return torch.finfo(dtype).min


def _flushing_subnormals() -> bool:
    """Whether this thread already flushes subnormal floats to zero (PyTorch has a setter only)."""
    return (torch.tensor(1e-39) * 2).item() == 0.0


def adds_logit_terms(encoding) -> bool:
    """Whether `encoding` adds anything to the logits (a `logit_bias` or `relative_logits` of its own)."""
    kind = type(encoding)
    return kind.logit_bias is not PositionalEncoding.logit_bias or \
        kind.relative_logits is not PositionalEncoding.relative_logits


def flush_subnormals_in_backward(last: Tensor, first: Tensor) -> None:
    """CPU: flush subnormal floats to zero while autograd runs the backward of one attention,
    from `last` (its output) down to `first` (q.k), unless the thread already does.

    Why: position terms of wide range (ALiBi's slope times distance, T5's far buckets, XL's
    relative logits) put many probabilities at exp(-87..-103), the subnormal range, and CPU
    arithmetic on subnormals is tens of times slower (docs/benchmarks.md). What is flushed is below 1.2e-38, far below what fp32 resolves
    in the sums it enters (the probabilities sum to 1). The thread's setting is restored at `first`,
    and at the end of the backward pass whatever happens in between."""
    if torch.compiler.is_compiling() or last.grad_fn is None or first.grad_fn is None or last.device.type != "cpu":
        return
    state = {}

    def stop(*_):
        if state.pop("set", False):
            torch.set_flush_denormal(False)

    def start(_):
        if "set" not in state and not _flushing_subnormals():
            state["set"] = torch.set_flush_denormal(True)
            torch.autograd.Variable._execution_engine.queue_callback(stop)

    last.grad_fn.register_prehook(start)
    first.grad_fn.register_hook(stop)


def _remembered_about_mask(attn_mask: Tensor, question: str, *geometry, answer: Callable[[], bool]) -> bool:
    """`answer()` about `attn_mask`, computed once per mask tensor, in-place version, view geometry
    and `geometry` (one device sync) and remembered on the mask's storage owner: fairseq slices its
    buffered mask anew each call."""
    owner = attn_mask if attn_mask._base is None else attn_mask._base
    version = None if owner.is_inference() else owner._version  # inference tensors have no version
    key = (question, attn_mask.storage_offset(), tuple(attn_mask.stride()), tuple(attn_mask.shape), attn_mask.dtype,
           version, *geometry)
    remembered = owner.__dict__.setdefault("_posenc_mask_facts", {}) if version is not None else {}
    if key not in remembered:
        remembered[key] = answer()
    return remembered[key]


@torch.compiler.disable  # (the remembered answer lives on the tensor, which torch.compile cannot trace)
def blocks_future(attn_mask: Optional[Tensor], queries: int, keys: int) -> bool:
    """Whether the 2-D `attn_mask` (queries, keys) blocks (-inf or True) every key after its query,
    the queries being the last `queries` of the keys: fairseq's future mask. Checked once per mask
    (`_remembered_about_mask`)."""
    if attn_mask is None or attn_mask.dim() != 2 or tuple(attn_mask.shape) != (queries, keys) or queries < 2:
        return False

    def answer():
        blocked = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        future = torch.ones(queries, keys, dtype=torch.bool, device=attn_mask.device).triu(keys - queries + 1)
        return bool(blocked[future].all())
    return _remembered_about_mask(attn_mask, "blocks future", answer=answer)


@torch.compiler.disable
def only_blocks(attn_mask: Tensor) -> bool:
    """Whether the float `attn_mask` holds nothing but 0 and -inf (fairseq's future mask): its
    finite part adds nothing to the logits. Checked once per mask (`_remembered_about_mask`)."""
    return _remembered_about_mask(attn_mask, "only blocks", answer=lambda: bool(
        (torch.isneginf(attn_mask) | (attn_mask == 0)).all()))


#: queries per block when relative terms are computed a block at a time (see `query_block_size`)
QUERY_BLOCK = 128
#: ... and the size of one block's logits, in elements, below which the call is not split
QUERY_BLOCK_ELEMENTS = 2 ** 20
#: ... times this on the fused CPU training path (biased_attention.py), which keeps a block's terms
#: but not its logits and probabilities: each block's backward gives full-size gradients of the
#: keys, values and the encoding's distance terms, summed over the blocks, so fewer blocks cost
#: less (docs/benchmarks.md)
FUSED_BLOCK_FACTOR = 4


def query_block_size(batch_heads: int, keys: int, fused: bool = False) -> int:
    """Queries per block for encodings with relative terms (Shaw, LFHC, XL, GCDF): QUERY_BLOCK, or
    more where a block of logits would stay under QUERY_BLOCK_ELEMENTS (short keys, small batch),
    so that short inputs run in one piece as before; `fused`: FUSED_BLOCK_FACTOR times as many
    elements."""
    elements = QUERY_BLOCK_ELEMENTS * (FUSED_BLOCK_FACTOR if fused else 1)
    return max(QUERY_BLOCK, elements // max(1, batch_heads * keys))


class PositionalAttention(MultiheadAttention):
    position_binding: Optional[PositionBinding] = None

    def bind_position(self, encoding, role: str, layer: int):
        self.position_binding = PositionBinding(encoding, role, layer) if encoding is not None else None

    def __prepare_scriptable__(self):
        raise RuntimeError(TORCHSCRIPT_MESSAGE)

    # --- head pruning (fairseq's AdaPrune: trainer `--mha-heads-to-keep`, `_adaptive_prune_heads`) ---
    def _adaptive_prune_heads(self, reserve_head_index: List[Tuple[int, int]]):
        """fairseq's pruning, plus a record of which original heads remain (in their new order):
        per-head position terms (ALiBi slopes, T5 columns, XL u/v, ...) stay with their head."""
        previous = self._kept_heads()
        self.__dict__.setdefault("full_heads", self.num_heads)  # what the encoding's per-head terms cover
        full_biases = {which: self.full_projection_bias(which) for which in "qkv"}
        full_biases = {which: b.detach().clone() for which, b in full_biases.items() if b is not None}
        super()._adaptive_prune_heads(reserve_head_index)
        chosen = torch.tensor([start // self.head_dim for start, _ in reserve_head_index], dtype=torch.long)
        kept = previous.cpu()[chosen] if previous is not None else chosen
        self.register_buffer("kept_heads", kept.to(self.q_proj.weight.device))
        for which, bias in full_biases.items():  # the pruned heads' biases (kept heads' entries zero)
            self.register_buffer(f"pruned_{which}_bias", bias.index_fill(0, self._kept_channels(), 0.0))

    def _kept_channels(self) -> Tensor:
        kept = self._kept_heads()
        return (kept[:, None] * self.head_dim + torch.arange(self.head_dim, device=kept.device)[None, :]).reshape(-1)

    def full_projection_bias(self, which: str) -> Optional[Tensor]:
        """The bias of `{which}_proj` over all the original heads: after head pruning the kept
        heads' entries are the live parameter (gradients flow) and the pruned heads' entries are
        their values at pruning time. FLOATER's ODE runs on full-size initial values b(0)."""
        bias = getattr(self, f"{which}_proj").bias
        if bias is None or self._kept_heads() is None:
            return bias
        return self._buffers[f"pruned_{which}_bias"].index_copy(0, self._kept_channels(), bias)

    def full_projection_bias_sources(self, which: str) -> List[Tensor]:
        """The tensors `full_projection_bias(which)` is computed from (what a value kept from it
        depends on: after pruning that bias is a new tensor at every call)."""
        sources = (getattr(self, f"{which}_proj").bias, self._buffers.get(f"pruned_{which}_bias"), self._kept_heads())
        return [tensor for tensor in sources if tensor is not None]

    def _kept_heads(self) -> Optional[Tensor]:
        return self._buffers.get("kept_heads")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "kept_heads"
        if key in state_dict and "kept_heads" not in self._buffers:
            # a pruned checkpoint loaded into a model pruned the same way before loading: adopt it
            self.register_buffer("kept_heads", torch.empty_like(state_dict[key]))
            self.__dict__.setdefault("full_heads", self.num_heads)
            for which in "qkv":
                if prefix + f"pruned_{which}_bias" in state_dict:
                    self.register_buffer(f"pruned_{which}_bias", torch.empty_like(state_dict[prefix + f"pruned_{which}_bias"]))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if self.bias_k is not None or self.add_zero_attn:
            raise NotImplementedError("posenc_fairseq attention does not support add_bias_kv / add_zero_attn")
        if need_head_weights:
            need_weights = True
        tgt_len, bsz, embed_dim = query.size()
        heads, head_dim = self.num_heads, self.head_dim
        binding = self.position_binding
        encoding = binding.encoding if binding is not None else None

        saved_state = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        if saved_state is not None and "prev_key" in saved_state and static_kv:
            key = value = None  # cross-attention keys/values were cached at the first step

        # --cross-self-attention: the decoder self-attention keys are cat(source, target)
        cross_self = binding is not None and binding.role == "decoder" and not self.self_attention \
            and not self.encoder_decoder_attention
        query_positions, key_positions = self._token_positions(binding)
        source_keys = 0  # keys (cached or not) that are source tokens, before the target keys
        if cross_self:
            source_positions = encoding.token_positions.get("source")
            source_keys = source_positions.size(1) if source_positions is not None else 0
            if key is not None and key.size(0) == source_keys + tgt_len and source_positions is not None:
                key_positions = torch.cat([source_positions, key_positions], dim=1)
        q = self._project("q", query, query_positions)
        k = v = None
        if self.self_attention:
            key = value = query
        if key is not None:
            if self.encoder_decoder_attention and self.beam_size > 1 and bsz == key.size(1):
                # fairseq's beamable cross-attention: keep one copy of the source per sentence
                key = value = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
                if key_positions is not None:
                    key_positions = key_positions.view(-1, self.beam_size, key_positions.size(1))[:, 0, :]
            k = self._project("k", key, key_positions)
            v = self._project("v", value, key_positions)

        q = q.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)  # (B, H, T, D)
        if k is not None:
            k = k.view(k.size(0), -1, heads, head_dim).permute(1, 2, 0, 3)
            v = v.view(v.size(0), -1, heads, head_dim).permute(1, 2, 0, 3)

        if saved_state is not None:
            if "prev_key" in saved_state:
                k = saved_state["prev_key"] if static_kv else torch.cat([saved_state["prev_key"], k], dim=2)
                v = saved_state["prev_value"] if static_kv else torch.cat([saved_state["prev_value"], v], dim=2)
            key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
                key_padding_mask=key_padding_mask,
                prev_key_padding_mask=saved_state.get("prev_key_padding_mask"),
                batch_size=k.size(0),
                src_len=k.size(2),
                static_kv=static_kv,
            )
            saved_state["prev_key"], saved_state["prev_value"] = k, v
            saved_state["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, saved_state)

        if k.size(0) != bsz:  # beamable cross-attention: share keys across the beams
            repeat = bsz // k.size(0)
            k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.repeat_interleave(repeat, 0)
        src_len = k.size(2)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None

        # Relative positions of this call: queries are the last tgt_len of the (target) keys. With
        # --cross-self-attention the relative terms cover the target keys only (nothing on the
        # source keys, as on cross-attention).
        relative = encoding is not None and not self.encoder_decoder_attention
        if relative and source_keys and src_len < source_keys + tgt_len:
            raise RuntimeError(f"cross-self-attention: {src_len} keys cannot hold {source_keys} source "
                               f"and {tgt_len} target tokens")
        target_len = src_len - source_keys
        # built from Python integers: the encodings read their bounds without a device sync
        q_pos = position_range(target_len - tgt_len, target_len, q.device)
        k_pos = position_range(0, target_len, q.device)
        k_target = k[:, :, source_keys:] if source_keys else k
        q = q * self.scaling
        # fairseq's future mask (checked): keys after a query are blocked, their terms may be skipped
        future_blocked = relative and not source_keys and blocks_future(attn_mask, tgt_len, src_len)
        terms = dict(encoding=encoding, binding=binding, relative=relative, k_target=k_target, k_pos=k_pos,
                     attn_mask=attn_mask, key_padding_mask=key_padding_mask, source_keys=source_keys,
                     fused=not (need_weights or before_softmax), future_blocked=future_blocked,
                     call_logits=bsz * heads * tgt_len * src_len)  # (of all blocks: biased.applies)
        call_logits = terms["call_logits"]
        value_term = relative and encoding.has_relative_values(binding.role, binding.layer)

        # Shaw/LFHC/XL/GCDF: relative logits that need a gradient go through the explicit softmax:
        # SDPA with such a mask falls back to its unfused kernel, which keeps more memory
        step_terms = self._step_terms(binding, relative, tgt_len, source_keys, need_weights or before_softmax,
                                      q_pos, k_pos)
        # XL/GCDF's u.k_j: folded into the product with the keys, (q + u).k_j, where every key
        # carries the relative terms and no head is pruned (one (B, H, Tq, Tk) addition fewer)
        content_query = None
        if step_terms is None and relative and not source_keys:
            content_query = encoding.content_query(binding.role, binding.layer, q.dtype)
            if content_query is not None and (self._kept_heads() is not None or self._flex_applies(
                    q, encoding, binding, relative, attn_mask, source_keys, terms["fused"])):
                content_query = None
        terms["content_folded"] = content_query is not None
        q_keys = q if content_query is None else q + content_query
        query_blocks = relative and getattr(encoding, "query_blocks", False)
        # whether the blocks' terms (if they need a gradient) take the fused CPU path: see `_attend`
        fused_path = not value_term and biased.serves_call(q, self._dropout_probability(), call_logits)
        block = query_block_size(bsz * heads, src_len, fused=fused_path)
        if query_blocks and not (need_weights or before_softmax) and tgt_len > block:
            # Long input, relative terms: one block of queries at a time, so that the relative terms
            # (and their distances) of one block only exist at once; exactly the same result. Under
            # the future mask a block leaves out the keys after its last query (all blocked).
            probs = None
            parts = []
            # The fused CPU path (biased_attention.py) keeps a block's output, log-sum-exp and terms
            # only (not its logits and probabilities). Under the future mask those terms cover the
            # keys up to the block's last query, half of all pairs: such blocks are not recomputed
            # (the trade-off measured in docs/benchmarks.md).
            fused_blocks = future_blocked and fused_path
            for start in range(0, tgt_len, block):
                rows = slice(start, min(start + block, tgt_len))
                first = target_len - tgt_len  # position of the first query
                rows_pos = position_range(first + rows.start, first + rows.stop, q.device)
                target_keys = first + rows.stop if future_blocked else target_len
                keys = source_keys + target_keys
                block_terms = dict(
                    terms, k_target=k_target[:, :, :target_keys], k_pos=position_range(0, target_keys, q.device),
                    attn_mask=attn_mask[..., rows, :keys] if attn_mask is not None else None,
                    key_padding_mask=key_padding_mask[:, :keys] if key_padding_mask is not None else None)

                def block_output(q_rows, rows_pos=rows_pos, keys=keys, block_terms=block_terms):
                    additive = self._additive(q_rows, rows_pos, **block_terms)
                    explicit = self._explicit_for_gradient(q_rows, additive, call_logits)
                    q_keys = q_rows if content_query is None else q_rows + content_query
                    return self._attend(q_keys, k[:, :, :keys], v[:, :, :keys], additive, value_term, rows_pos,
                                        explicit=explicit, **block_terms)[0]

                if torch.is_grad_enabled() and not encoding.in_recorded_run() and not fused_blocks:
                    # Keep only the block's inputs for backward and recompute its relative terms and
                    # probabilities there (same dropout mask: the RNG state is restored), so a
                    # training step holds one block's (B, H, block, S) at a time, not the whole
                    # (B, H, n, S) per layer. (Inside a checkpointed layer the layer's checkpoint
                    # covers the blocks.)
                    parts.append(checkpoint(encoding.recorded(block_output), q[:, :, rows], use_reentrant=False))
                else:
                    parts.append(block_output(q[:, :, rows]))
            out = torch.cat(parts, dim=2)
        elif step_terms is not None:
            # one query (a decoding step) of Shaw/LFHC/XL/GCDF: the position terms are additions to
            # the query, keys, values and logits, and the step is plain (fused) attention
            if step_terms.query is not None:
                q = q + step_terms.query.to(q.dtype)
            if step_terms.keys is not None:
                k = k + step_terms.keys.to(k.dtype)
            if step_terms.values is not None:
                v = v + step_terms.values.to(v.dtype)
            additive = None
            if attn_mask is not None or key_padding_mask is not None:
                additive = self._additive(q, q_pos, **dict(terms, relative=False))
            if step_terms.logits is not None:
                logits = step_terms.logits.to(q.dtype)
                additive = logits if additive is None else additive + logits
            if additive is not None:
                additive = additive.expand(bsz, heads, 1, src_len)
            out, probs = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=1.0,  # (q is scaled)
                                                        dropout_p=self._dropout_probability()), None
        else:
            additive = self._additive(q, q_pos, **terms)
            if need_weights or before_softmax or value_term:
                if before_softmax:
                    logits = q_keys @ k.transpose(-1, -2)
                    if additive is not None:
                        logits = logits + additive
                    return logits.reshape(bsz * heads, tgt_len, src_len), v.reshape(bsz * heads, src_len, head_dim)
                out, probs = self._attend(q_keys, k, v, additive, value_term, q_pos, explicit=True, **terms)
            else:
                explicit = query_blocks and self._explicit_for_gradient(q, additive, call_logits)
                out, probs = self._attend(q_keys, k, v, additive, False, q_pos, explicit=explicit, **terms)
                probs = None
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, heads * head_dim)
        out = self.out_proj(out)

        weights = None
        if need_weights:
            weights = probs.transpose(0, 1)  # (H, B, T, S)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights

    def _step_terms(self, binding, relative: bool, tgt_len: int, source_keys: int, explicit: bool,
                    q_pos: Tensor, k_pos: Tensor) -> Optional[StepTerms]:
        """The encoding's `step_terms` where the call can use them: one query, relative terms on
        every key (no --cross-self-attention source keys), no head pruning, and the caller asks
        for neither weights nor logits."""
        if not relative or tgt_len != 1 or source_keys or explicit or self._kept_heads() is not None:
            return None
        return binding.encoding.step_terms(binding.role, binding.layer, q_pos, k_pos)

    def _additive(self, q: Tensor, q_pos: Tensor, encoding, binding, relative: bool, k_target: Tensor,
                  k_pos: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                  source_keys: int, fused: bool = False, future_blocked: bool = False,
                  content_folded: bool = False, **_) -> Optional[Tensor]:
        """Everything added to the scaled logits of the queries `q` (B, H, Tq, D) at positions
        `q_pos` (the rows of `attn_mask`): the position terms, the attention mask's finite part and
        the blocked entries (mask and padding) as a large negative number; (B or 1, H or 1, Tq, S).
        `future_blocked`: the mask blocks every key after its query (the encoding may leave any
        finite value there). `content_folded`: the caller adds the encoding's `content_query` to the
        queries of its product with the keys (the encoding leaves that term out).
        None where `_attend` takes the fused path, which reads them itself (`_flex_applies`)."""
        if self._flex_applies(q, encoding, binding, relative, attn_mask, source_keys, fused):
            return None
        kept = self._kept_heads()
        additive = None
        if relative:
            bias = encoding.logit_bias(binding.role, binding.layer, q_pos, k_pos)
            if bias is not None and kept is not None:
                bias = bias[kept]
            if kept is None:
                rel = encoding.relative_logits(binding.role, binding.layer, q, k_target, q_pos, k_pos,
                                               future_blocked=future_blocked, content_folded=content_folded)
            else:
                rel = encoding.relative_logits(binding.role, binding.layer, self._all_heads(q, 1),
                                               self._all_heads(k_target, 1), q_pos, k_pos,
                                               future_blocked=future_blocked)
                rel = rel[:, kept] if rel is not None else None
            for term in (bias, rel):
                if term is not None:
                    term = term.to(q.dtype)
                    if source_keys:
                        term = F.pad(term, (source_keys, 0))
                    additive = term if additive is None else additive + term
        blocked = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                blocked = attn_mask
            else:
                blocked = torch.isneginf(attn_mask)
                if not only_blocks(attn_mask):  # (fairseq's future mask: no full-size addition of zeros)
                    finite = attn_mask.masked_fill(blocked, 0).to(q.dtype)
                    additive = finite if additive is None else additive + finite
        if key_padding_mask is not None:
            padding = key_padding_mask.to(torch.bool).view(key_padding_mask.size(0), 1, 1, -1)
            blocked = padding if blocked is None else (blocked | padding)
        if blocked is not None:
            if additive is None:
                additive = torch.zeros((), dtype=q.dtype, device=q.device)
            additive = additive.masked_fill(blocked, blocked_fill_value(q.dtype))
        return additive

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, additive: Optional[Tensor], value_term: bool, q_pos: Tensor,
                encoding, binding, k_pos: Tensor, source_keys: int, explicit: bool = False, relative: bool = False,
                attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None, fused: bool = False,
                future_blocked: bool = False, call_logits: int = 0, **_) -> Tuple[Tensor, Optional[Tensor]]:
        """Attention output (B, H, Tq, D) of the queries `q` and the probabilities where they are
        computed explicitly (weights asked for, or a relative value term); otherwise fused:
        FlexAttention with the encoding's per-distance terms (`_flex_applies`), or SDPA."""
        if not (explicit or value_term) and self._flex_applies(q, encoding, binding, relative, attn_mask,
                                                                source_keys, fused):
            distance = encoding.distance_logits(binding.role, binding.layer, q, k, q_pos, k_pos)
            out = flex.attend(q, k, v, distance, attn_mask, key_padding_mask, blocked_fill_value(q.dtype))
            return out, None
        if not (explicit or value_term):
            if biased.applies(q, additive, self._dropout_probability(), call_logits):
                out = biased.attend(q, k, v, additive, future_blocked)  # (CPU: SDPA has no fused gradient for its mask)
            else:
                if additive is not None:
                    additive = additive.expand(q.size(0), q.size(1), q.size(2), k.size(2))
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=additive, scale=1.0,  # q is already scaled
                    dropout_p=self._dropout_probability(),
                )
            if relative and additive is not None and adds_logit_terms(encoding):
                flush_subnormals_in_backward(out, out)
            return out, None
        products = q @ k.transpose(-1, -2)
        logits = products if additive is None else products + additive
        probs = torch.softmax(logits.float(), dim=-1).type_as(logits)
        dropped = self.dropout_module(probs) if self._dropout_probability() > 0 else probs
        out = dropped @ v
        if value_term:
            kept = self._kept_heads()
            target_probs = dropped[..., source_keys:] if source_keys else dropped
            if kept is None:
                term = encoding.relative_values(binding.role, binding.layer, target_probs, q_pos, k_pos)
            else:
                term = encoding.relative_values(binding.role, binding.layer, self._all_heads(target_probs, 1),
                                                q_pos, k_pos)
                term = term[:, kept] if term is not None else None
            if term is not None:
                out = out + term.to(out.dtype)
        if relative and additive is not None and adds_logit_terms(encoding):
            flush_subnormals_in_backward(out, products)
        return out, probs

    def _explicit_for_gradient(self, q: Tensor, additive: Optional[Tensor], call_logits: int) -> bool:
        """Relative logits that need a gradient take the explicit softmax, unless the fused CPU
        path with its own backward serves them (biased_attention.py): SDPA's unfused fallback for
        such a mask keeps more memory than the explicit softmax."""
        return (additive is not None and additive.requires_grad
                and not biased.applies(q, additive, self._dropout_probability(), call_logits))

    def _flex_applies(self, q: Tensor, encoding, binding, relative: bool, attn_mask: Optional[Tensor],
                      source_keys: int, fused: bool) -> bool:
        """Whether the call of the queries `q` takes the FlexAttention path (flex_attention.py): the
        caller asked for neither weights nor logits (`fused`), FlexAttention is on for the device,
        the encoding gives its terms per distance, and nothing needs the explicit path: no
        relative value term, attention dropout, head pruning or --cross-self-attention keys, and
        a 2-D attn_mask (fairseq's)."""
        return (fused and relative and flex.supports(encoding) and flex.available(q)
                and not encoding.has_relative_values(binding.role, binding.layer)
                and self._dropout_probability() == 0.0 and self._kept_heads() is None and not source_keys
                and (attn_mask is None or attn_mask.dim() == 2))

    def _dropout_probability(self) -> float:
        """What the dropout module itself would apply now: in training, and at inference when
        fairseq's --retain-dropout set `apply_during_inference` on it."""
        module = self.dropout_module
        applies = module.training or getattr(module, "apply_during_inference", False)
        return float(module.p) if applies else 0.0

    def _all_heads(self, x: Tensor, dim: int) -> Tensor:
        """After head pruning: `x` with the kept heads along `dim` put back among zeros for the
        pruned ones, in the original head order the encoding's per-head terms are indexed by."""
        kept = self._kept_heads()
        shape = list(x.shape)
        shape[dim] = self.__dict__.get("full_heads", self.num_heads)
        full = x.new_zeros(shape)
        return full.index_copy(dim, kept, x)

    def _token_positions(self, binding) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Absolute (B, T) positions of the tokens projected in this call, for the project hook."""
        if binding is None:
            return None, None
        encoding, role = binding.encoding, binding.role
        query_role = "decoder" if role == "cross" else role
        key_role = "source" if role == "cross" else role
        return encoding.token_positions.get(query_role), encoding.token_positions.get(key_role)

    def _project(self, which: str, x: Tensor, positions: Optional[Tensor]) -> Tensor:
        """`{which}_proj(x)`, with the encoding's per-token bias and its project hook."""
        projection = self._modules[which + "_proj"]  # (once per projection of every decoding step)
        binding = self.position_binding
        if binding is None:
            return projection(x)
        kept = self._kept_heads()
        bias = binding.encoding.projection_bias(binding.role, binding.layer, which, positions)
        if bias is None:
            y = projection(x)
        else:
            if kept is not None:  # the encoding's bias covers all the original heads
                bias = bias.index_select(-1, self._kept_channels())
            if type(projection) is torch.nn.Linear and not (projection._forward_hooks or projection._forward_pre_hooks):
                if bias.dim() == 1:  # one bias for every token (a decoding step)
                    y = F.linear(x, projection.weight, bias)
                elif x.size(0) == 1:  # a decoding step: the fewest calls
                    y = F.linear(x, projection.weight) + bias
                elif bias.size(1) != x.size(1):  # (T, 1, E): one row of biases shared by the batch
                    y = F.linear(x, projection.weight).add_(bias)
                else:  # the per-token bias is the product's input: no separate pass over (T, B, E)
                    y = torch.addmm(bias.reshape(-1, bias.size(-1)), x.reshape(-1, x.size(-1)),
                                    projection.weight.t()).view(*x.shape[:-1], -1)
            else:  # e.g. fairseq's quant-noise hooks on the projection
                y = projection(x) - projection.bias + bias
        if kept is None:
            return binding.encoding.project(binding.role, binding.layer, which, y, positions)
        length, batch, _ = y.shape
        full = self._all_heads(y.view(length, batch, len(kept), self.head_dim), 2)
        full = binding.encoding.project(binding.role, binding.layer, which, full.view(length, batch, -1), positions)
        return full.view(length, batch, -1, self.head_dim)[:, :, kept].reshape(length, batch, -1)
