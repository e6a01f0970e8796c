"""The one attention module every encoding plugs into.

`PositionalAttention` is fairseq's `MultiheadAttention` (same parameters, names, initialisation,
incremental-state layout and beam handling) with a forward that asks a bound
`PositionalEncoding` for optional terms (see `encodings/base.py`):

    projection_bias     per-token bias of the q/k/v projections              (FLOATER)
    project(q|k|v)      position-dependent change of the projected q/k/v    (rotary)
    distance_term       the logit term per key - query distance              (T5, AT5, ALiBi, Shaw, LFHC, XL, GCDF)
    value_term          a term on the values per distance                    (Shaw, LFHC)

A forward is: project (q, k, v, the incremental cache, beams) -> positions (an `AttentionCall`)
-> plan (`kernels.plan.plan`: which kernel serves the call) -> kernel (`kernels.serve`) -> output
projection. docs/design.md draws it; the kernels and the query blocks of long inputs are in
`kernels/`.

Positions are explicit: in self-attention the queries are the last `q_len` of the `k_len` keys
(the cache holds the earlier ones), so query i has position k_len - q_len + i during step-by-step
decoding exactly as in the full forward pass. The encodings are asked for the call's key - query
distances as Python integers (no device synchronisation).

fairseq features handled here (see README, "Works with"):
- `--cross-self-attention`: the decoder self-attention keys are cat(source, target). The projection
  hooks (rotary, FLOATER) see the key positions cat(source positions, target positions); the
  distance terms cover the target keys only and add nothing on the source keys, exactly as they
  add nothing on cross-attention.
- head pruning (`_adaptive_prune_heads`): the module remembers which of the original heads it keeps
  (`kept_heads`, saved with the model) and each kept head keeps its own per-head position terms.
- `--retain-dropout`: attention dropout follows the dropout module's own decision
  (`FairseqDropout.apply_during_inference`) on every kernel.
- TorchScript: refused with one message (`__prepare_scriptable__`), see TORCHSCRIPT_MESSAGE.
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules import MultiheadAttention

from .encodings.base import HookUse, PassContext, hook_use
from .encodings.cache import stack_of
from .encodings.distance import for_heads
from .encodings.positions import AnyPositions, PaddedPositions, is_shared_range, shared_range, tensor_of
from .kernels.masks import blocks_future
from .kernels.plan import AttentionCall, Kernel, plan
from .kernels.serve import serve


def use_positional_attention(module: torch.nn.Module):
    """Turn every fairseq MultiheadAttention inside `module` into a PositionalAttention in place.

    The class swap keeps parameters, buffers and the stock initialisation untouched, so a model
    built this way starts from exactly the weights stock fairseq would give it.
    """
    for submodule in module.modules():
        if type(submodule) is MultiheadAttention:
            submodule.__class__ = PositionalAttention
            submodule.position_binding = None



def all_heads(x: Tensor, dim: int, kept: Tensor, heads: int) -> Tensor:
    """After head pruning: `x` with the `kept` heads along `dim` put back among zeros for the
    pruned ones, `heads` in all, in the original head order the encoding's per-head terms are
    indexed by."""
    shape = list(x.shape)
    shape[dim] = heads
    return x.new_zeros(shape).index_copy(dim, kept, x)


class PositionBinding:
    """Which encoding an attention module asks, in which role ('encoder', 'decoder', 'cross')
    and at which layer (0-based). Not a Module: the encoding's parameters are owned once, by the model."""

    def __init__(self, encoding, role: str, layer: int):
        self.encoding, self.role, self.layer = encoding, role, layer


def linear(module: torch.nn.Module, x: Tensor, calls_module: bool) -> Tensor:
    """module(x) where `calls_module`, else its weight and bias applied without calling it (no hooks
    run), as stock's fused attention path applies its projections."""
    return module(x) if calls_module else F.linear(x, module.weight, module.bias)


def bound_attentions(model: torch.nn.Module) -> List[Tuple[str, int, "PositionalAttention"]]:
    """(role, layer, attention) of every `PositionalAttention` of `model` bound to an encoding, in
    module order: what the model tells an encoding that keeps per-layer state of the attention
    modules (`bind_model`: FLOATER's slots are their q/k/v projections)."""
    return [(module.position_binding.role, module.position_binding.layer, module) for module in model.modules()
            if isinstance(module, PositionalAttention) and module.position_binding is not None]


TORCHSCRIPT_MESSAGE = (
    "posenc_fairseq models cannot be compiled with TorchScript (torch.jit.script): the positional "
    "encoding is one Python module shared by every layer that keeps per-forward state (the token "
    "positions each stack gives in its pass context, position terms memoized across layers, FLOATER's ODE table with its "
    "Python solver), which TorchScript cannot represent (torch.jit.trace neither). Run the model in eager "
    "mode (fairseq-generate, fairseq-interactive, hub interfaces) or with torch.compile; see README, "
    "'Works with'.")


NO_HOOKS = HookUse(projects=False, logits=False, values=False)

def first_of_each_beam(positions: AnyPositions, beam: int) -> AnyPositions:
    """The rows of `positions` (B * beam, T) of the first beam of each sentence, (B, T): a
    `shared_range` stays one (every row alike)."""
    if is_shared_range(positions):
        return shared_range(positions.rows // beam, positions.start, positions.stop, positions.device)
    rows = tensor_of(positions)
    firsts = rows.view(-1, beam, rows.size(1))[:, 0, :]  # (a sentence's beams share their source: same bound)
    return PaddedPositions(firsts, positions.stop) if isinstance(positions, PaddedPositions) else firsts


class PositionalAttention(MultiheadAttention):
    position_binding: Optional[PositionBinding] = None
    #: the heads before the first pruning (None: never pruned)
    full_heads: Optional[int] = None

    def bind_position(self, encoding, role: str, layer: int):
        self.position_binding = PositionBinding(encoding, role, layer) if encoding is not None else None

    def __prepare_scriptable__(self):
        raise RuntimeError(TORCHSCRIPT_MESSAGE)

    # --- head pruning (fairseq's AdaPrune: trainer `--mha-heads-to-keep`, `_adaptive_prune_heads`) ---
    def _adaptive_prune_heads(self, reserve_head_index: List[Tuple[int, int]]):
        """fairseq's pruning, plus a record of which original heads remain (in their new order):
        per-head position terms (ALiBi slopes, T5 columns, XL u/v, ...) stay with their head."""
        previous = self._kept_heads()
        if self.full_heads is None:
            self.full_heads = self.num_heads  # what the encoding's per-head terms cover
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

    def projection_bias_tensors(self, which: str) -> tuple:
        """The stored tensors that `full_projection_bias(which)` is made of."""
        bias = getattr(self, f"{which}_proj").bias
        return (bias,) if bias is None or self._kept_heads() is None else (bias, self._buffers[f"pruned_{which}_bias"])

    def _kept_heads(self) -> Optional[Tensor]:
        return self._buffers.get("kept_heads")

    def _full_heads(self) -> int:
        """The heads before pruning: what the encoding's per-head terms cover."""
        return self.num_heads if self.full_heads is None else self.full_heads

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "kept_heads"
        if key in state_dict and "kept_heads" not in self._buffers:
            # a pruned checkpoint loaded into a model pruned the same way before loading: adopt it
            self.register_buffer("kept_heads", torch.empty_like(state_dict[key]))
            if self.full_heads is None:
                self.full_heads = self.num_heads
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
        """fairseq's MultiheadAttention.forward: project, positions (`AttentionCall`), plan (which
        kernel), kernel, output projection (docs/design.md)."""
        if self.bias_k is not None or self.add_zero_attn:
            raise NotImplementedError("posenc_fairseq attention does not support add_bias_kv / add_zero_attn")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, _ = query.size()
        binding = self.position_binding
        use, context = NO_HOOKS, None
        if binding is not None:
            use, context = hook_use(binding.encoding), binding.encoding.contexts.get(stack_of(binding.role))
        # Stock's fused path (a call without incremental state or static keys) reads the projections'
        # weights without calling the modules, so their hooks (fairseq's --quant-noise-pq) do not run
        calls_modules = (incremental_state is not None or static_kv or self.skip_embed_dim_check
                         or self.onnx_trace)
        q, k, v, key_padding_mask, source_keys = self._projected(query, key, value, key_padding_mask,
                                                                  incremental_state, static_kv, use.projects, context,
                                                                  calls_modules)
        call = self._call(q, k, v, attn_mask, key_padding_mask, source_keys, need_weights, before_softmax, use,
                          context)
        call_plan = plan(call)
        out, probs = serve(call, call_plan, self._modules["dropout_module"])
        if call_plan.kernel is Kernel.LOGITS:  # fairseq's before_softmax: the logits and the values
            return out.reshape(-1, tgt_len, out.size(-1)), call.v.reshape(-1, out.size(-1), self.head_dim)
        out = linear(self._modules["out_proj"], out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, -1), calls_modules)
        weights = None
        if need_weights:
            weights = probs.transpose(0, 1)  # (H, B, T, S)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights

    def _projected(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                   key_padding_mask: Optional[Tensor], incremental_state, static_kv: bool, projects: bool,
                   context: Optional[PassContext], calls_modules: bool):
        """q (B, H, Tq, D), unscaled, and the keys and values (B, H, Tk, D) of the call: projected
        with the encoding's projection hooks (`projects`: it has some; the positions of the stack's
        pass `context`), by calling the projection modules where stock does (`calls_modules`), after
        the cached ones of incremental decoding, one copy per beam; the key padding mask that goes
        with them, and the number of source keys before the target keys (--cross-self-attention's
        decoder self-attention, else 0)."""
        tgt_len, bsz, _ = query.size()
        heads, head_dim = self.num_heads, self.head_dim
        binding = self.position_binding
        saved_state = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        if saved_state is not None and "prev_key" in saved_state and static_kv:
            key = value = None  # cross-attention keys/values were cached at the first step

        # --cross-self-attention: the decoder self-attention keys are cat(source, target)
        cross_self = binding is not None and binding.role == "decoder" and not self.self_attention \
            and not self.encoder_decoder_attention
        query_positions = key_positions = None  # (read by the projection hooks alone)
        if projects and context is not None:
            query_positions, key_positions = context.positions, context.key_positions(binding.role)
        source_keys = 0  # keys (cached or not) that are source tokens, before the target keys
        if cross_self and context is not None:
            source_keys, key_positions = self._source_keys(context, saved_state, key, tgt_len, key_positions, projects)
        q = self._project("q", query, query_positions, projects, calls_modules)
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
                    key_positions = first_of_each_beam(key_positions, self.beam_size)
            k = self._project("k", key, key_positions, projects, calls_modules)
            v = self._project("v", value, key_positions, projects, calls_modules)

        q = q.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)  # (B, H, T, D)
        if k is not None:
            k = k.view(k.size(0), -1, heads, head_dim).permute(1, 2, 0, 3)
            v = v.view(v.size(0), -1, heads, head_dim).permute(1, 2, 0, 3)

        if saved_state is not None:
            k, v, key_padding_mask = self._after_cached(k, v, key_padding_mask, incremental_state, saved_state,
                                                        static_kv)
        if k.size(0) != bsz:  # beamable cross-attention: share keys across the beams
            repeat = bsz // k.size(0)
            k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.repeat_interleave(repeat, 0)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        return q, k, v, key_padding_mask, source_keys

    @staticmethod
    def _source_keys(context: PassContext, saved_state, key: Optional[Tensor], tgt_len: int, key_positions,
                     projects: bool):
        """--cross-self-attention's decoder self-attention, whose keys are cat(source, target): how many
        of its keys (cached or not) are source tokens, and the key positions with the source's first
        where the projection hooks read them. Counted in this call's own keys (a later step: in its
        decode's cached keys, which hold the source and the earlier target tokens), not in the context's
        source: another decode's first step may have given that since."""
        if saved_state is not None and "prev_key" in saved_state:
            return saved_state["prev_key"].size(2) - context.earlier, key_positions
        if key is None:
            return 0, key_positions
        source_keys = key.size(0) - tgt_len
        if projects and source_keys and context.source is not None:
            key_positions = torch.cat([tensor_of(context.source), tensor_of(key_positions)], dim=1)
        return source_keys, key_positions

    def _after_cached(self, k: Optional[Tensor], v: Optional[Tensor], key_padding_mask: Optional[Tensor],
                      incremental_state, saved_state: Dict[str, Optional[Tensor]], static_kv: bool):
        """fairseq's incremental decoding: this call's keys, values (B, H, T, D) and key padding
        after the cached ones (static_kv: the cached ones alone), which the state then holds."""
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
        return k, v, key_padding_mask

    def _call(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
              source_keys: int, need_weights: bool, before_softmax: bool, use: HookUse,
              context: Optional[PassContext]) -> AttentionCall:
        """The `AttentionCall` of the projected q, k, v: the encoding's terms over the distances of
        the queries and target keys (the queries are the last Tq of the target keys; with
        --cross-self-attention the relative terms cover the target keys only, nothing on the source
        keys, as on cross-attention) and the facts the plan is made from. `use`: the encoding's
        hooks (without relative ones the call is plain attention and asks nothing)."""
        binding = self.position_binding
        encoding = binding.encoding if binding is not None else None
        bsz, heads, tgt_len, _ = q.shape
        src_len = k.size(2)
        self_attention = encoding is not None and not self.encoder_decoder_attention
        term = values = None
        if self_attention and (use.logits or use.values):
            if source_keys and src_len < source_keys + tgt_len:
                raise RuntimeError(f"cross-self-attention: {src_len} keys cannot hold {source_keys} source "
                                   f"and {tgt_len} target tokens")
            # key - query distances: from the last query (position target_len - 1) to the first key,
            # to the first query (target_len - tgt_len) to the last key
            target_len = src_len - source_keys
            low, high = 1 - target_len, tgt_len - 1
            role, layer, kept = binding.role, binding.layer, self._kept_heads()
            if use.logits:
                term = for_heads(encoding.distance_term(role, layer, low, high, tgt_len, q.dtype), kept)
            if use.values:
                values = for_heads(encoding.value_term(role, layer, low, high, tgt_len, q.dtype), kept)
        relative = term is not None or values is not None
        # the mask the decoder stack made in this pass: fairseq's future mask (0 and -inf), known unread
        stack_mask = attn_mask is not None and context is not None and attn_mask is context.future_mask
        # fairseq's future mask: keys after a query are blocked, their terms may be skipped
        future_blocked = (relative and not source_keys and attn_mask is not None
                          and blocks_future(attn_mask, tgt_len, src_len, stack_mask))
        return AttentionCall(
            q=q * self.scaling, k=k, v=v, k_target=k[:, :, source_keys:] if source_keys else k,
            attn_mask=attn_mask, key_padding_mask=key_padding_mask, source_keys=source_keys,
            need_weights=need_weights, before_softmax=before_softmax, term=term, values=values,
            future_blocked=future_blocked, dropout_p=self._dropout_probability(),
            logits=bsz * heads * tgt_len * src_len, grad_enabled=torch.is_grad_enabled(), stack_mask=stack_mask,
            # what the kernels of relative terms use of the encoding and the pass
            recorded_run=relative and encoding.in_recorded_run(),
            flex_mode=context.flex_mode if relative and context is not None else "off",
            triton_mode=context.triton_mode if relative and context is not None else "off",
            memoize=encoding.memoize if relative else None, recorded=encoding.recorded if relative else None)

    def _dropout_probability(self) -> float:
        """What the dropout module itself would apply now: in training, and at inference when
        fairseq's --retain-dropout set `apply_during_inference` on it."""
        module = self._modules["dropout_module"]
        applies = module.training or getattr(module, "apply_during_inference", False)
        return float(module.p) if applies else 0.0

    def _project(self, which: str, x: Tensor, positions: Optional[AnyPositions], projects: bool,
                 calls_modules: bool) -> Tensor:
        """`{which}_proj(x)`, with the encoding's per-token bias and its project hook (`projects`: it
        has some); the module called (its hooks run) only where `calls_modules`, as in stock."""
        projection = self._modules[which + "_proj"]  # (once per projection of every decoding step)
        binding = self.position_binding
        if not projects:
            return linear(projection, x, calls_modules)
        kept = self._kept_heads()
        bias = binding.encoding.projection_bias(binding.role, binding.layer, which, positions)
        if bias is None:
            y = linear(projection, x, calls_modules)
        else:
            if kept is not None:  # the encoding's bias covers all the original heads
                bias = bias.index_select(-1, self._kept_channels())
            hooked = calls_modules and bool(projection._forward_hooks or projection._forward_pre_hooks)
            if type(projection) is torch.nn.Linear and not hooked:
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
        full = all_heads(y.view(length, batch, len(kept), self.head_dim), 2, kept, self._full_heads())
        full = binding.encoding.project(binding.role, binding.layer, which, full.view(length, batch, -1), positions)
        return full.view(length, batch, -1, self.head_dim)[:, :, kept].reshape(length, batch, -1)
