"""Shaw-RPE (Shaw et al., 2018) and LFHC-RPE (Qu et al., EMNLP 2021): learned relative embeddings
added to the keys (and optionally the values) of self-attention.

    e_ij = q_i . (k_j + a^K_ij) / sqrt(d_head)        z_i = sum_j alpha_ij (v_j + a^V_ij)
    a^K_ij = w^K[clip(j - i, k)],  a^V_ij = w^V[clip(j - i, k)],  w^K, w^V in R^{(2k+1) x d_head}

one table pair per self-attention layer, shared by the heads; relative = key - query. LFHC
replaces clip by eq. 9 of Qu et al. at layer l (counted from 1, so layer 1 is Shaw):

    clip^l(x, k) = k if x > kl;  floor(x / l) if -kl <= x <= kl;  -k if x < -kl

taken literally, i.e. floor also for negative x (floor(-1/2) = -1, so -1 and -2 share a bucket
at layer 2 while 0 and 1 share one). Same number of parameters as Shaw.

Memory: never an (n, n, d_head) tensor. The query meets the 2k+1 embeddings once, (B, H, Tq,
2k+1), and that is gathered to (B, H, Tq, Tk) with a (Tq, Tk) bucket-index matrix; the value term
sums the attention probabilities per bucket (scatter-add, (B, H, Tq, 2k+1)) and multiplies by w^V.
Nothing on cross-attention; nothing sized to a maximum length.
"""
import argparse

import torch
from torch import Tensor, nn

from .base import PositionalEncoding, register_encoding

SELF_ROLES = ("encoder", "decoder")


def switch(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("on", "true", "yes", "1"):
        return True
    if str(value).lower() in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off, got {value!r}")


def shaw_buckets(relative: Tensor, k: int) -> Tensor:
    """clip(x, k) = max(-k, min(k, x)), shifted to 0..2k (table rows)."""
    return relative.clamp(-k, k) + k


def lfhc_buckets(relative: Tensor, k: int, layer: int) -> Tensor:
    """Eq. 9 at 1-based layer `layer`, shifted to 0..2k. floor(x / l) for both signs (literal)."""
    return torch.div(relative, layer, rounding_mode="floor").clamp(-k, k) + k


@register_encoding("shaw")
class Shaw(PositionalEncoding):
    default_input_positions = "none"  # Shaw et al.: no sinusoidal input encoding in addition
    option_prefix = "shaw"

    def __init__(self, args, dims):
        super().__init__(args, dims)
        prefix = self.option_prefix.replace("-", "_")
        self.k = int(getattr(args, f"{prefix}_k", None) or 16)
        values = getattr(args, f"{prefix}_values", None)
        self.values = True if values is None else switch(values)
        size = (2 * self.k + 1, dims.head_dim)
        self.key_tables = nn.ParameterDict()
        self.value_tables = nn.ParameterDict()
        for role in SELF_ROLES:
            for layer in range(dims.layers(role)):
                self.key_tables[f"{role}{layer}"] = nn.Parameter(self._init(size))
                if self.values:
                    self.value_tables[f"{role}{layer}"] = nn.Parameter(self._init(size))

    @staticmethod
    def _init(size):
        weight = torch.empty(size)
        nn.init.xavier_uniform_(weight)
        return weight

    @classmethod
    def add_args(cls, parser):
        p = cls.option_prefix
        parser.add_argument(f"--{p}-k", type=int, metavar="K",
                            help=f"{cls.name}: maximum clipped relative distance k, 2k+1 embeddings per layer (default 16)")
        parser.add_argument(f"--{p}-values", type=switch, metavar="on|off",
                            help=f"{cls.name}: also add a^V_ij to the values (default on, as in Shaw et al.'s "
                                 "full model; they found it unnecessary for MT)")

    # --- buckets ------------------------------------------------------------------------------
    def bucket_of(self, relative: Tensor, layer: int) -> Tensor:
        """Table row (0..2k) of relative distance j - i at 0-based `layer`."""
        return shaw_buckets(relative, self.k)

    def buckets(self, role: str, layer: int, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        def compute():
            relative = key_positions[None, :] - query_positions[:, None]
            return self.bucket_of(relative, layer)
        return self.memoize((role, self.name, self._layer_key(layer), int(query_positions[0]),
                             len(query_positions), len(key_positions)), compute)

    def _layer_key(self, layer):
        return 0  # Shaw: the same index matrix at every layer

    # --- hooks ----------------------------------------------------------------------------------
    def relative_logits(self, role, layer, query, key, query_positions, key_positions):
        if role not in SELF_ROLES:
            return None
        table = self.key_tables[f"{role}{layer}"].to(query.dtype)
        scores = query @ table.t()  # (B, H, Tq, 2k+1); query is already scaled by 1/sqrt(d)
        index = self.buckets(role, layer, query_positions, key_positions)  # (Tq, Tk)
        batch, heads, tq, _ = scores.shape
        return scores.gather(-1, index.expand(batch, heads, tq, index.size(-1)))

    def has_relative_values(self, role, layer):
        return self.values and role in SELF_ROLES

    def relative_values(self, role, layer, probs, query_positions, key_positions):
        if not self.has_relative_values(role, layer):
            return None
        table = self.value_tables[f"{role}{layer}"]
        index = self.buckets(role, layer, query_positions, key_positions)
        batch, heads, tq, tk = probs.shape
        per_bucket = probs.new_zeros(batch, heads, tq, table.size(0))
        per_bucket = per_bucket.scatter_add(-1, index.expand(batch, heads, tq, tk), probs)
        return per_bucket @ table.to(probs.dtype)  # (B, H, Tq, D)

    def reset_to_identity(self):
        with torch.no_grad():
            for table in list(self.key_tables.values()) + list(self.value_tables.values()):
                table.zero_()


@register_encoding("lfhc")
class LFHC(Shaw):
    """Shaw with eq. 9's layer-dependent clip: layer l (1-based) buckets floor((j - i) / l)."""

    option_prefix = "lfhc"

    def bucket_of(self, relative, layer):
        return lfhc_buckets(relative, self.k, layer + 1)

    def _layer_key(self, layer):
        return layer
