"""ALiBi (Press et al., 2022): a fixed linear penalty on the logits, -m_h * |j - i|.

Symmetric |i - j| in the encoder, the same formula in the causal decoder (where only j <= i is
visible), nothing on cross-attention. Slopes m_h are the paper's geometric sequence. No
parameters and no table: any length works, including step-by-step generation, where the query
position is the current step (the ALiBi fairseq fork drops the bias there).
"""
import math

import torch
from torch import Tensor

from .base import DistanceLogits, PositionalEncoding, distance_range, register_encoding
from .positions import bounds, tensor_of


def alibi_slopes(heads: int) -> Tensor:
    """m_h = 2^(-8h/n) for n heads (h = 1..n) when n is a power of two; otherwise the slopes of the
    nearest lower power of two followed by every other slope of the next one (the paper's recipe)."""

    def power_of_two(n):
        start = 2 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    if math.log2(heads).is_integer():
        return torch.tensor(power_of_two(heads))
    lower = 2 ** math.floor(math.log2(heads))
    return torch.tensor(power_of_two(lower) + power_of_two(2 * lower)[0::2][: heads - lower])


@register_encoding("alibi")
class ALiBi(PositionalEncoding):
    default_input_positions = "none"
    starts_as_identity = False  # fixed by design: nothing to set to zero

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.register_buffer("slopes", alibi_slopes(dims.heads), persistent=False)

    def logit_bias(self, role, layer, query_positions, key_positions):
        if role == "cross":
            return None

        def compute():
            return self.penalty(tensor_of(key_positions)[None, :] - tensor_of(query_positions)[:, None])
        (q_low, _), (k_low, _) = bounds(query_positions), bounds(key_positions)  # no device sync
        return self.memoize((role, "alibi", q_low, len(query_positions), k_low, len(key_positions)), compute)

    def penalty(self, distance: Tensor) -> Tensor:
        """-m_h |d| of key - query distances `distance` (any shape) -> (heads, *distance.shape)."""
        return -self.slopes.view(-1, *[1] * distance.dim()) * distance.abs()

    def distance_logits(self, role, layer, query, key, query_positions, key_positions):
        """The penalty per distance, (1, H, 1, Tq + Tk - 1), once per forward."""
        if role == "cross":
            return None
        low, high = distance_range(query_positions, key_positions)

        def compute():
            return self.penalty(torch.arange(low, high + 1, device=self.slopes.device))[None, :, None, :]
        return DistanceLogits(self.memoize((role, "alibi per distance", low, high), compute))
