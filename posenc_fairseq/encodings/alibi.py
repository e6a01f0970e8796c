"""ALiBi (Press et al., 2022): a fixed linear penalty on the logits, -m_h * |j - i|.

Symmetric |i - j| in the encoder, the same formula in the causal decoder (where only j <= i is
visible), nothing on cross-attention. Slopes m_h are the paper's geometric sequence. No
parameters and no table: any length works, including step-by-step generation, where the query
position is the current step (the ALiBi fairseq fork drops the bias there).
"""
import math

import torch
from torch import Tensor

from .base import PositionalEncoding, register_encoding
from .distance import DistanceTerm


def alibi_slopes(heads: int) -> Tensor:
    """m_h = 2^(-8h/n) for n heads (h = 1..n) when n is a power of two; otherwise the slopes of the
    nearest lower power of two followed by every other slope of the next one (the paper's recipe).
    In float64, from which a model's dtype is rounded once."""

    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    if math.log2(heads).is_integer():
        return torch.tensor(power_of_two(heads), dtype=torch.float64)
    lower = 2 ** math.floor(math.log2(heads))
    return torch.tensor(power_of_two(lower) + power_of_two(2 * lower)[0::2][: heads - lower], dtype=torch.float64)


@register_encoding("alibi")
class ALiBi(PositionalEncoding):
    default_input_positions = "none"
    starts_as_identity = False  # fixed by design: nothing to set to zero

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.register_buffer("slopes", alibi_slopes(dims.heads).to(torch.get_default_dtype()), persistent=False)

    def _apply(self, fn, recurse=True):
        """Module.to/half/float/...: the slopes made anew in the dtype and device they are moved to, so
        that a round trip through a lower precision (.half() then .float()) leaves no rounding in them, and
        a float64 model has them in float64."""
        super()._apply(fn, recurse)
        self.slopes = alibi_slopes(self.slopes.numel()).to(self.slopes)
        return self

    def penalty(self, distance: Tensor) -> Tensor:
        """-m_h |d| of key - query distances `distance` (any shape) -> (heads, *distance.shape)."""
        return -self.slopes.view(-1, *[1] * distance.dim()) * distance.abs()

    def distance_term(self, role, layer, low, high, queries, dtype):
        """The penalty per distance, once per forward (the same in every layer)."""
        if role == "cross":
            return None

        def compute():
            return self.penalty(torch.arange(low, high + 1, device=self.slopes.device))
        bias = self.memoize(self.term_key(role, "per distance", low, high), compute)
        return DistanceTerm(low, high, bias=bias, key=self.term_key(role, "per distance"))
