"""The one attention module every encoding plugs into.

`PositionalAttention` is fairseq's `MultiheadAttention` (same parameters, names, initialisation,
incremental-state layout and beam handling) with a forward that asks a bound
`PositionalEncoding` for four optional terms (see `encodings/base.py`):

    project(q|k|v)      position-dependent change of the projected q/k/v    (FLOATER, rotary)
    logit_bias          (heads, q_len, k_len) added to the scaled logits     (T5, AT5, ALiBi)
    relative_logits     query against relative embeddings, (B, H, q, k)      (Shaw, LFHC, XL, GCDF)
    relative_values     probabilities mixed into relative value embeddings   (Shaw, LFHC)

Positions are explicit: in self-attention the queries are the last `q_len` of the `k_len` keys
(the cache holds the earlier ones), so query i has position k_len - q_len + i during step-by-step
decoding exactly as in the full forward pass.
"""
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules import MultiheadAttention


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


def blocked_fill_value(dtype: torch.dtype) -> float:
    """Finite 'minus infinity' for masks: exp() of it underflows to 0 in softmax, and unlike -inf
    a fully masked row gives uniform weights instead of NaN, in fp16/bf16 as in fp32."""
    return torch.finfo(dtype).min


class PositionalAttention(MultiheadAttention):
    position_binding: Optional[PositionBinding] = None

    def bind_position(self, encoding, role: str, layer: int):
        self.position_binding = PositionBinding(encoding, role, layer) if encoding is not None else None

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

        query_positions, key_positions = self._token_positions(binding)
        q = self._project("q", self.q_proj(query), query_positions)
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
            k = self._project("k", self.k_proj(key), key_positions)
            v = self._project("v", self.v_proj(value), key_positions)

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

        # Relative positions of this call: queries are the last tgt_len of src_len positions.
        relative = encoding is not None and not self.encoder_decoder_attention
        q_pos = torch.arange(src_len - tgt_len, src_len, device=q.device)
        k_pos = torch.arange(src_len, device=q.device)
        q = q * self.scaling

        additive = None  # everything added to the scaled logits, (B or 1, H or 1, T, S)
        if encoding is not None:
            bias = encoding.logit_bias(binding.role, binding.layer, q_pos, k_pos) if relative else None
            rel = encoding.relative_logits(binding.role, binding.layer, q, k, q_pos, k_pos) if relative else None
            for term in (bias, rel):
                if term is not None:
                    term = term.to(q.dtype)
                    additive = term if additive is None else additive + term
        blocked = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                blocked = attn_mask
            else:
                blocked = torch.isneginf(attn_mask)
                finite = attn_mask.masked_fill(blocked, 0).to(q.dtype)
                additive = finite if additive is None else additive + finite
        if key_padding_mask is not None:
            padding = key_padding_mask.to(torch.bool).view(bsz, 1, 1, src_len)
            blocked = padding if blocked is None else (blocked | padding)
        if blocked is not None:
            if additive is None:
                additive = torch.zeros((), dtype=q.dtype, device=q.device)
            additive = additive.masked_fill(blocked, blocked_fill_value(q.dtype))

        value_term = relative and encoding.has_relative_values(binding.role, binding.layer)
        if need_weights or before_softmax or value_term:
            logits = q @ k.transpose(-1, -2)
            if additive is not None:
                logits = logits + additive
            if before_softmax:
                return logits.reshape(bsz * heads, tgt_len, src_len), v.reshape(bsz * heads, src_len, head_dim)
            probs = torch.softmax(logits.float(), dim=-1).type_as(logits)
            dropped = self.dropout_module(probs)
            out = dropped @ v
            if value_term:
                out = out + encoding.relative_values(binding.role, binding.layer, dropped, q_pos, k_pos).to(out.dtype)
        else:
            probs = None
            if additive is not None:
                additive = additive.expand(bsz, heads, tgt_len, src_len)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=additive, scale=1.0,  # q is already scaled
                dropout_p=self.dropout_module.p if self.training else 0.0,
            )
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        out = self.out_proj(out)

        weights = None
        if need_weights:
            weights = probs.transpose(0, 1)  # (H, B, T, S)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights

    def _token_positions(self, binding) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Absolute (B, T) positions of the tokens projected in this call, for the project hook."""
        if binding is None:
            return None, None
        encoding, role = binding.encoding, binding.role
        query_role = "decoder" if role == "cross" else role
        key_role = "source" if role == "cross" else role
        return encoding.token_positions.get(query_role), encoding.token_positions.get(key_role)

    def _project(self, which: str, x: Tensor, positions: Optional[Tensor]) -> Tensor:
        binding = self.position_binding
        if binding is None:
            return x
        return binding.encoding.project(binding.role, binding.layer, which, x, positions)
