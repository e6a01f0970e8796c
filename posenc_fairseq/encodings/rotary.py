"""Rotary position embedding (RoFormer, Su et al. 2021) on self-attention queries and keys.

Each head's vector is split into pairs (x_m, x_{m + D/2}) ("rotate half" layout) and pair m of the
token at position p is rotated by the angle p * base^(-2m/D). Then q_i . k_j depends on positions
only through i - j. Keys are rotated before they enter the incremental cache, at their absolute
position, so step-by-step decoding equals the full pass; no table, so any length works.
Cross-attention is left alone (source and target positions are not comparable). The rotation
(cos, sin) of the positions a stack announces is computed once per pass and shared by the queries
and keys of every layer (a decoding step: once per step).
"""
from typing import Tuple

import torch
from torch import Tensor

from .base import PositionalEncoding, register_encoding
from .cache import stack_of
from .option_types import float_in_range
from .positions import is_shared_range, tensor_of

#: base of the rotation frequencies base^(-2m/D): positive (0 and negative bases give inf/NaN
#: angles); bounded by float32, in which the frequencies of a float32 or half model are computed
base_type = float_in_range(0.0, 3.0e38, low_open=True)


def rotation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rotations are computed in: float32 for half models (angles of long positions need
    it), float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def rotation(positions: Tensor, head_dim: int, base: float = 10000.0, constants=None, dtype=torch.float32):
    """cos and signed sin (T, B, 1, D) in `dtype` of the angles p * base^(-2m/D) of positions (B, T),
    laid out as `apply_rotation` reads them: dimension m and m + D/2 both get pair m's angle, the sin
    is negative in the first half (an odd D's last dimension: cos 1, sin 0, it is not rotated).
    `constants`: `rotation_constants` of the same head_dim, base, device and dtype, if kept."""
    if constants is None:
        constants = rotation_constants(head_dim, base, positions.device, dtype)
    frequencies, sign = constants
    angles = positions.t().to(frequencies.dtype)[..., None] * frequencies  # (T, B, D)
    return angles.cos()[:, :, None, :], (angles.sin() * sign)[:, :, None, :]


def rotation_constants(head_dim: int, base: float, device, dtype=torch.float32) -> Tuple[Tensor, Tensor]:
    """The frequency (D,) of each dimension, base^(-2m/D) for m and m + D/2, and the sign of its sin."""
    half = head_dim // 2
    frequencies = base ** (-torch.arange(half, device=device, dtype=dtype) * 2 / head_dim)
    odd = torch.zeros(head_dim - 2 * half, device=device, dtype=dtype)
    ones = torch.ones(half, device=device, dtype=dtype)
    return torch.cat([frequencies, frequencies, odd]), torch.cat([-ones, ones, odd])


def apply_rotation(x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """x (T, B, heads * D) rotated by `rotation`'s cos and sin, in their dtype: pair m of a head,
    (x_m, x_{m + D/2}), becomes (x_m cos - x_{m + D/2} sin, x_{m + D/2} cos + x_m sin), i.e.
    x * cos + swapped(x) * signed sin in three operations (a decoding step pays per operation)."""
    length, batch, embed = x.shape
    head_dim = embed // heads
    half = head_dim // 2
    x = x.view(length, batch, heads, head_dim).to(cos.dtype)
    if head_dim % 2 == 0:
        swapped = x.roll(half, dims=-1)
    else:
        swapped = torch.cat([x[..., half: 2 * half], x[..., :half], x[..., 2 * half:]], dim=-1)
    return torch.addcmul(x * cos, swapped, sin).reshape(length, batch, embed)


def rotate(x: Tensor, positions: Tensor, heads: int, base: float = 10000.0) -> Tensor:
    """x (T, B, heads * D), positions (B, T) -> x with every head rotated by its positions."""
    cos, sin = rotation(positions.to(x.device), x.size(-1) // heads, base, dtype=rotation_dtype(x.dtype))
    return apply_rotation(x, cos, sin, heads)


@register_encoding("rotary")
class Rotary(PositionalEncoding):
    default_input_positions = "none"
    starts_as_identity = False  # fixed by design: nothing to set to zero

    @staticmethod
    def add_args(parser):
        parser.add_argument("--rotary-base", type=base_type, metavar="B",
                            help="rotation base, 0 < B <= 3e38 (default 10000)")

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.base = self.defining_option(args, "rotary_base", base_type, 10000.0)

    def project(self, role, layer, which, x, positions):
        if role == "cross" or which == "v":
            return x
        head_dim, dtype = x.size(-1) // self.dims.heads, rotation_dtype(x.dtype)
        context = self.contexts.get(stack_of(role))
        if context is not None and positions is context.positions:
            # the positions the stack gave for this pass (a decoding step: the current one): one
            # rotation for the queries and keys of every layer
            cos, sin, matrix = self.memoize(
                self.term_key(role, "rotation", tensor_of(positions).shape, head_dim, x.device, dtype),
                lambda: self._pass_rotation(role, positions, head_dim, x.device, dtype))
            if matrix is not None:  # one position for every token: one product per projection
                length, batch, embed = x.shape
                return (x.view(length, batch, -1, head_dim).to(dtype) @ matrix).view(length, batch, embed).to(x.dtype)
        else:  # e.g. --cross-self-attention's keys cat(source, target)
            cos, sin = rotation(tensor_of(positions).to(x.device), head_dim, self.base, dtype=dtype)
        return apply_rotation(x, cos, sin, self.dims.heads).to(x.dtype)

    def _pass_rotation(self, role: str, positions, head_dim: int, device, dtype):
        """`rotation` of a stack's announced positions (one row where every row is alike), and where
        it is one position for every token (a decoding step without padding), also the rotation as a
        (D, D) matrix M, x @ M == apply_rotation(x): diag(cos) plus the signed sin moved to row
        (m + D/2) mod D of column m (even D)."""
        rows = positions.tensor[:1] if is_shared_range(positions) else tensor_of(positions)
        cos, sin = rotation(rows.to(device), head_dim, self.base, self._constants(head_dim, device, dtype))
        matrix = None
        if cos.size(0) == 1 and cos.size(1) == 1 and head_dim % 2 == 0:
            matrix = torch.diag(cos.view(-1)) + torch.diag(sin.view(-1)).roll(head_dim // 2, dims=0)
        return cos, sin, matrix

    def _constants(self, head_dim: int, device, dtype) -> Tuple[Tensor, Tensor]:
        """`rotation_constants`, kept (a decoding step computes one rotation; these never change)."""
        return self.cache.constant(("rotary", head_dim, self.base, device, dtype, torch.is_inference_mode_enabled()),
                                   lambda: rotation_constants(head_dim, self.base, device, dtype))
