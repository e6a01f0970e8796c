"""Adaptive T5 (Wu et al., AAAI 2021): a learnable bucketing function and an MLP bucket embedding,
and its ablation AT5-NoB.

For relative position d = j - i (key minus query) and head h, with A = 1 / length scale:

    d > 0:   b+ = 1 - exp(-A * relu(gamma+_h) * d)        e_h(d) = MLP+_h(b+)    (paper eqs. 17-18)
    d <= 0:  b- = 1 - exp( A * relu(gamma-_h) * d)        e_h(d) = MLP-_h(b-)    (paper eqs. 19-20)

and e_h(d) is added to the scaled logits (paper eq. 5). The causal decoder uses only the d <= 0
branch (as the authors' code; keys after the query, masked anyway, get e_h(0)). gamma is per
head and direction, initialised uniformly in [Gamma_min, Gamma_max]; A is a constant (default
1/256, the authors' MT setting), not the batch's length, so the bucket of a distance never
depends on the batch and b saturates to 1 at long distances (any length works). Each MLP is
1 -> h1 -> h2 -> 1 with the chosen activation after both hidden layers and dropout after the
first, one per head and direction (run for all heads at once with batched weights).

AT5-NoB: the same MLPs fed the raw distance scaled to [0, 1], min(|d| * A, 1); no gamma.

Layers, sharing and the prior: as T5 (see t5.py: `--scalar-bias-layers`,
`--scalar-bias-share-layers`, `prior_distribution`).
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import register_encoding
from .t5 import ScalarBias, _add_once, add_scalar_bias_args, prior_distribution  # noqa: F401

ACTIVATIONS = {"sigmoid": torch.sigmoid, "relu": F.relu, "tanh": torch.tanh, "gelu": F.gelu}


class HeadMLPs(nn.Module):
    """One MLP 1 -> h1 -> h2 -> 1 per head, evaluated for every head at once: (heads, D) -> (heads, D)."""

    def __init__(self, heads: int, widths, activation: str, dropout: float):
        super().__init__()
        h1, h2 = widths
        self.w1, self.b1 = nn.Parameter(torch.empty(heads, h1)), nn.Parameter(torch.empty(heads, h1))
        self.w2, self.b2 = nn.Parameter(torch.empty(heads, h1, h2)), nn.Parameter(torch.empty(heads, h2))
        self.w3, self.b3 = nn.Parameter(torch.empty(heads, h2)), nn.Parameter(torch.empty(heads))
        self.activation = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)
        # nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), per layer
        for fan_in, tensors in ((1, (self.w1, self.b1)), (h1, (self.w2, self.b2)), (h2, (self.w3, self.b3))):
            for tensor in tensors:
                nn.init.uniform_(tensor, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.activation(x[:, :, None] * self.w1[:, None, :] + self.b1[:, None, :])  # (H, D, h1)
        hidden = self.dropout(hidden)
        hidden = self.activation(torch.einsum("hdi,hij->hdj", hidden, self.w2) + self.b2[:, None, :])
        return torch.einsum("hdj,hj->hd", hidden, self.w3) + self.b3[:, None]

    def reset_to_identity(self):
        with torch.no_grad():
            self.w3.zero_()
            self.b3.zero_()


@register_encoding("at5")
class AT5Bias(ScalarBias):
    """AT5: learnable exponential buckets + one MLP per head and direction."""

    uses_gamma = True

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.length_scale = float(getattr(args, "at5_length_scale", None) or 256)
        gamma_range = getattr(args, "at5_gamma_range", None) or (1.0, 10.0)
        widths = getattr(args, "at5_mlp_widths", None) or (32, 4)
        activation = getattr(args, "at5_activation", None) or "sigmoid"
        dropout = float(getattr(args, "at5_dropout", None) or 0.0)
        if self.length_scale <= 0 or len(gamma_range) != 2 or len(widths) != 2:
            raise ValueError("--at5-length-scale must be positive; --at5-gamma-range and --at5-mlp-widths take two values")
        self.mlps = nn.ModuleDict()
        self.gammas = nn.ParameterDict()
        for key in self.table_keys():
            for direction in self.directions(key):
                name = f"{key}_{direction}"
                self.mlps[name] = HeadMLPs(dims.heads, [int(w) for w in widths], activation, dropout)
                if self.uses_gamma:
                    self.gammas[name] = nn.Parameter(
                        torch.empty(dims.heads).uniform_(float(gamma_range[0]), float(gamma_range[1])))

    @staticmethod
    def add_args(parser):
        add_scalar_bias_args(parser)
        _add_once(parser, "--at5-gamma-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                  help="at5: gamma+- initialised uniformly in [MIN, MAX]; default 1 10")
        _add_once(parser, "--at5-length-scale", type=float, metavar="L",
                  help="at5/at5_nob: A = 1/L in b = 1 - exp(-A relu(gamma) |d|) (at5_nob: input min(|d|/L, 1)); "
                       "a constant, not the batch length; default 256")
        _add_once(parser, "--at5-mlp-widths", type=int, nargs=2, metavar=("H1", "H2"),
                  help="at5/at5_nob: hidden widths of the per-head MLP 1 -> H1 -> H2 -> 1; default 32 4")
        _add_once(parser, "--at5-activation", choices=sorted(ACTIVATIONS),
                  help="at5/at5_nob: activation of the MLP's hidden layers; default sigmoid")
        _add_once(parser, "--at5-dropout", type=float, metavar="P",
                  help="at5/at5_nob: dropout after the MLP's first layer; default 0")

    def directions(self, key: str):
        """The encoder looks both ways; the causal decoder only at d <= 0."""
        return ("minus", "plus") if self.key_role(key) == "encoder" else ("minus",)

    def bucket(self, name: str, distance: Tensor) -> Tensor:
        """(heads, D) input of the MLP for the non-negative distances |d| on one side."""
        scale = distance.to(self.gammas[name].dtype) / self.length_scale
        return 1 - torch.exp(-F.relu(self.gammas[name])[:, None] * scale[None, :])

    def distance_bias(self, key, low, high):
        device = next(self.mlps.parameters()).device
        if self.key_role(key) != "encoder":  # causal: one branch, future keys as d = 0
            distance = torch.arange(low, high + 1, device=device).neg().clamp(min=0)
            return self.mlps[f"{key}_minus"](self.bucket(f"{key}_minus", distance))
        parts = []
        if low <= 0:  # d = low .. min(high, 0)
            distance = torch.arange(low, min(high, 0) + 1, device=device).neg()
            parts.append(self.mlps[f"{key}_minus"](self.bucket(f"{key}_minus", distance)))
        if high > 0:  # d = max(low, 1) .. high
            distance = torch.arange(max(low, 1), high + 1, device=device)
            parts.append(self.mlps[f"{key}_plus"](self.bucket(f"{key}_plus", distance)))
        return torch.cat(parts, dim=1)

    def reset_to_identity(self):
        for mlp in self.mlps.values():
            mlp.reset_to_identity()


@register_encoding("at5_nob")
class AT5NoBuckets(AT5Bias):
    """AT5-NoB: the MLPs read min(|d| / L, 1) directly (no learnable bucketing, no gamma)."""

    uses_gamma = False

    def bucket(self, name, distance):
        scaled = (distance.to(self.mlps[name].w1.dtype) / self.length_scale).clamp(max=1.0)
        return scaled[None, :].expand(self.dims.heads, -1)
