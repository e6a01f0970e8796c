"""Adaptive T5 (Wu et al., AAAI 2021): a learnable bucketing function and an MLP bucket embedding,
and its ablation AT5-NoB.

For relative position d = j - i (key minus query) and head h, with A = 1 / length scale:

    d > 0:   b+ = 1 - exp(-A * gamma+_h * d)        e_h(d) = MLP+_h(b+)    (paper eqs. 17-18)
    d <= 0:  b- = 1 - exp( A * gamma-_h * d)        e_h(d) = MLP-_h(b-)    (paper eqs. 19-20)

and e_h(d) is added to the scaled logits (paper eq. 5). The causal decoder uses only the d <= 0
branch (as the authors' code; keys after the query, masked anyway, get e_h(0)). gamma is per
head and direction, initialised in [Gamma_min, Gamma_max]: by default spread geometrically over the
heads from 1 to L (A * gamma from 1/L to 1: every layer starts with heads that tell d = 1 from 2 and
heads that resolve distances up to about L; issue 37, docs/scalar_bias.md), or drawn uniformly (the
paper: --at5-gamma-init uniform --at5-gamma-range 1 10); A is a constant (default
1/256, the authors' MT setting), not the batch's length, so the bucket of a distance never
depends on the batch and b saturates to 1 at long distances (any length works). Each MLP is
1 -> h1 -> h2 -> 1 with the chosen activation after both hidden layers and dropout after the
first, one per head and direction (run for all heads at once with batched weights).

The paper writes max(0, gamma) of a free gamma; here gamma = exp(GAMMA_STEP_SCALE * raw) > 0 and
every MLP parameter is MLP_STEP_SCALE * raw (the same functions at initialisation, steps an
ordinary optimiser can take: see the constants below and docs/scalar_bias.md). Checkpoints of
the old parameterisation (gammas.*, mlps.*.w1 ..) load converted to the same bias.

AT5-NoB: the same MLPs fed the raw distance scaled to [0, 1], min(|d| * A, 1); no gamma (the
paper's text). `--at5-nob-input learned` is the authors' code instead (BDBC-KG-NLP/AAAI2021-
Scalar-Embedding-of-Relative-Positions, soft_t5_attention_nob.py): a learned scalar s_h(d) per
head and relative position, initialised U(0, 1), fed as sigmoid(s_h(d)) to one MLP per head
(both directions); positions clipped to +-floor(L) (their table spans the maximum length).

Layers and sharing: as T5 (see t5.py: `--scalar-bias-layers`, `--scalar-bias-share-layers`); the
prior: prior.py.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import register_encoding
from .option_types import (Checker, OptionValueError, check_size, float_in_range, int_in_range, one_of, option,
                           option_pair, ordered_pair, probability)
from .t5 import ScalarBias, _add_once, add_scalar_bias_args

ACTIVATIONS = {"sigmoid": torch.sigmoid, "relu": F.relu, "tanh": torch.tanh, "gelu": F.gelu}
NOB_INPUTS = ("distance", "learned")
GAMMA_INITS = ("uniform", "geometric")
#: gamma beyond this saturates b at every distance (and overflows float32 products); also the cap
#: of the learned gamma, so that exp never overflows to inf (inf * 0 at d = 0 would give NaN)
MAX_GAMMA = 1e4
#: The parameterisation (issue 27): Adam moves every stored value by about lr per update whatever its
#: gradient, and AT5's effective weights need to travel far (MLP slopes of tens per unit of b, gamma
#: in the tens to hundreds) from gradients at or below Adam's eps. So each MLP parameter is stored
#: divided by MLP_STEP_SCALE and used multiplied by it (the same function, a step and a gradient
#: that many times larger; a power of two, so s * (theta / s) == theta exactly), and gamma is
#: exp(GAMMA_STEP_SCALE * stored value): always positive (relu(gamma) of a raw value could be
#: pushed below 0 and never come back) and moved by a relative step of about GAMMA_STEP_SCALE * lr.
MLP_STEP_SCALE = 32.0
GAMMA_STEP_SCALE = 8.0
#: the smallest gamma represented (an old checkpoint's gamma <= 0): b = 0 at every distance in float32
GAMMA_FLOOR = 1e-30
MAX_WIDTH = 1024
gamma_type = float_in_range(0.0, MAX_GAMMA)
length_scale_type = Checker(float, 1.0, name="at5_length_scale")
width_type = int_in_range(1, MAX_WIDTH)


class HeadMLPs(nn.Module):
    """One MLP 1 -> h1 -> h2 -> 1 per head, evaluated for every head at once: (heads, D) -> (heads, D).

    Each weight and bias is stored as `NAME_raw` and used as MLP_STEP_SCALE * NAME_raw (see
    MLP_STEP_SCALE); the properties w1 .. b3 give the effective values."""

    PARAMETERS = ("w1", "b1", "w2", "b2", "w3", "b3")

    def __init__(self, heads: int, widths, activation: str, dropout: float):
        super().__init__()
        h1, h2 = widths
        shapes = {"w1": (heads, h1), "b1": (heads, h1), "w2": (heads, h1, h2), "b2": (heads, h2),
                  "w3": (heads, h2), "b3": (heads,)}
        fan_ins = {"w1": 1, "b1": 1, "w2": h1, "b2": h1, "w3": h2, "b3": h2}
        self.activation = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)
        for name in self.PARAMETERS:
            # nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), per layer, drawn
            # for the MLP as it computes (a seed gives the MLP of the unscaled layout), stored divided by the scale
            raw = nn.Parameter(torch.empty(shapes[name]))
            nn.init.uniform_(raw, -1 / math.sqrt(fan_ins[name]), 1 / math.sqrt(fan_ins[name]))
            with torch.no_grad():
                raw.div_(MLP_STEP_SCALE)
            self.register_parameter(f"{name}_raw", raw)

    def effective(self, name: str) -> Tensor:
        return MLP_STEP_SCALE * getattr(self, f"{name}_raw")

    w1 = property(lambda self: self.effective("w1"))
    b1 = property(lambda self: self.effective("b1"))
    w2 = property(lambda self: self.effective("w2"))
    b2 = property(lambda self: self.effective("b2"))
    w3 = property(lambda self: self.effective("w3"))
    b3 = property(lambda self: self.effective("b3"))

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.w1_raw.dtype)
        hidden = self.activation(x[:, :, None] * self.w1[:, None, :] + self.b1[:, None, :])  # (H, D, h1)
        hidden = self.dropout(hidden)
        hidden = self.activation(torch.einsum("hdi,hij->hdj", hidden, self.w2) + self.b2[:, None, :])
        return torch.einsum("hdj,hj->hd", hidden, self.w3) + self.b3[:, None]

    def reset_to_identity(self):
        with torch.no_grad():
            self.w3_raw.zero_()
            self.b3_raw.zero_()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # checkpoints from before the rescaling store the effective values under the plain names
        for name in self.PARAMETERS:
            if prefix + name in state_dict and prefix + name + "_raw" not in state_dict:
                state_dict[prefix + name + "_raw"] = state_dict.pop(prefix + name) / MLP_STEP_SCALE
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def initial_gammas(heads: int, gamma_range, how: str) -> Tensor:
    """(heads,) initial gammas in [MIN, MAX]: uniform draws (the paper), or geometric,
    gamma_h = MIN * (MAX / MIN) ** (h / (heads - 1)) for h = 0 .. heads - 1 (one head: MAX)."""
    low, high = gamma_range
    if how == "uniform":
        return torch.empty(heads).uniform_(low, high)
    if heads == 1:
        return torch.full((1,), float(high))
    exponents = torch.arange(heads, dtype=torch.float64) / (heads - 1)
    return (low * (high / low) ** exponents).float()


def raw_gamma(gamma: Tensor) -> Tensor:
    """The stored parameter of gamma: log(gamma) / GAMMA_STEP_SCALE; gamma <= 0 (relu's dead zone
    in the old parameterisation) maps to GAMMA_FLOOR, whose bucket is 0 at every distance as relu(gamma)'s."""
    return gamma.clamp(min=GAMMA_FLOOR).log() / GAMMA_STEP_SCALE


@register_encoding("at5")
class AT5Bias(ScalarBias):
    """AT5: learnable exponential buckets + one MLP per head and direction."""

    uses_gamma = True

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.length_scale = self.defining_option(args, "at5_length_scale", length_scale_type, 256.0)
        gamma_range = option_pair(args, "at5_gamma_range", gamma_type, (1.0, self.length_scale), ordered=True)
        if gamma_range[1] == 0:
            raise OptionValueError("--at5-gamma-range 0 0: expected MAX > 0 (gamma = 0 gives "
                                   "b = 0 at every distance and no gradient to gamma)")
        gamma_init = option(args, "at5_gamma_init", one_of(*GAMMA_INITS), "geometric")
        if gamma_init == "geometric" and gamma_range[0] == 0:
            raise OptionValueError(f"--at5-gamma-init geometric --at5-gamma-range {gamma_range[0]:g} "
                                   f"{gamma_range[1]:g}: expected MIN > 0 (a geometric spread starts above 0); for "
                                   "the paper's uniform draws pass --at5-gamma-init uniform (a checkpoint from before "
                                   "geometric became the default: --model-overrides \"{'at5_gamma_init': 'uniform'}\")")
        widths = self.defining_option(args, "at5_mlp_widths", width_type, (32, 4), read=option_pair)
        activation = self.defining_option(args, "at5_activation", one_of(*sorted(ACTIVATIONS)), "sigmoid")
        dropout = option(args, "at5_dropout", probability, 0.0)
        read_nob_input = option if self.uses_gamma else self.defining_option  # (at5_nob reads it)
        self.nob_input = read_nob_input(args, "at5_nob_input", one_of(*NOB_INPUTS), "distance")
        if self.uses_gamma:
            self.not_read(args, "at5_nob_input", "only at5_nob reads it")
        else:
            self.not_read(args, "at5_gamma_range", "at5_nob has no gamma")
            self.not_read(args, "at5_gamma_init", "at5_nob has no gamma")
        self.mlps = nn.ModuleDict()
        self.raw_gammas = nn.ParameterDict()  # gamma = exp(GAMMA_STEP_SCALE * raw), see gamma()
        names = [f"{key}_{direction}" for key in self.table_keys() for direction in self.directions(key)]
        h1, h2 = widths
        check_size(f"--at5-mlp-widths {h1} {h2}", len(names) * dims.heads * (2 * h1 + h1 * h2 + 2 * h2 + 1),
                   f"the {self.name} MLPs")
        for name in names:
            self.mlps[name] = HeadMLPs(dims.heads, widths, activation, dropout)
            if self.uses_gamma:
                self.raw_gammas[name] = nn.Parameter(raw_gamma(initial_gammas(dims.heads, gamma_range, gamma_init)))

    @staticmethod
    def add_args(parser):
        add_scalar_bias_args(parser)
        _add_once(parser, "--at5-gamma-range", type=gamma_type, nargs=2, metavar=("MIN", "MAX"),
                  action=ordered_pair(gamma_type, positive_max=True),
                  help=f"at5: gamma+- start in [MIN, MAX] (--at5-gamma-init), 0 <= MIN <= MAX <= {MAX_GAMMA:g}, "
                       "MAX > 0; default 1 L (L: --at5-length-scale; the paper: 1 10, its MT run 1 15)")
        _add_once(parser, "--at5-gamma-init", choices=GAMMA_INITS,
                  help="at5: how gamma+- start in --at5-gamma-range: geometric (default), spread over the heads "
                       "from MIN to MAX (MIN > 0), so that every layer has local and long-range heads, as "
                       "ALiBi's slopes; or uniform, drawn per head (the paper)")
        _add_once(parser, "--at5-length-scale", type=length_scale_type, metavar="L",
                  help="at5/at5_nob: A = 1/L in b = 1 - exp(-A gamma |d|) (at5_nob: input min(|d|/L, 1)); "
                       "a constant length in tokens (>= 1), not the batch length; default 256")
        _add_once(parser, "--at5-mlp-widths", type=width_type, nargs=2, metavar=("H1", "H2"),
                  help=f"at5/at5_nob: hidden widths of the per-head MLP 1 -> H1 -> H2 -> 1, 1..{MAX_WIDTH}; default 32 4")
        _add_once(parser, "--at5-activation", choices=sorted(ACTIVATIONS),
                  help="at5/at5_nob: activation of the MLP's hidden layers; default sigmoid")
        _add_once(parser, "--at5-dropout", type=probability, metavar="P",
                  help="at5/at5_nob: dropout after the MLP's first layer, 0 <= P < 1; default 0")
        _add_once(parser, "--at5-nob-input", choices=NOB_INPUTS,
                  help="at5_nob: MLP input min(|d|/L, 1) (distance: the paper's text, default) or sigmoid of a "
                       "learned scalar per head and relative position clipped to +-L (learned: the authors' code)")

    def bias_options(self):
        return (self.length_scale, self.nob_input, getattr(self, "max_distance", None),
                tuple(mlp.activation for mlp in self.mlps.values()))

    def directions(self, key: str):
        """The encoder looks both ways; the causal decoder only at d <= 0."""
        return ("minus", "plus") if self.key_role(key) == "encoder" else ("minus",)

    def gamma(self, name: str) -> Tensor:
        """(heads,) effective gamma of one direction, in float32 or wider (fp16 would overflow exp)."""
        raw = self.raw_gammas[name]
        log_gamma = GAMMA_STEP_SCALE * raw.to(torch.promote_types(raw.dtype, torch.float32))
        return log_gamma.clamp(max=math.log(MAX_GAMMA)).exp()

    def bucket(self, name: str, distance: Tensor) -> Tensor:
        """(heads, D) input of the MLP for the non-negative distances |d| on one side."""
        gamma = self.gamma(name)
        scale = distance.to(gamma.dtype) / self.length_scale
        return 1 - torch.exp(-gamma[:, None] * scale[None, :])

    def side_bias(self, name: str, distance: Tensor) -> Tensor:
        return self.mlps[name](self.bucket(name, distance))

    def distance_bias(self, key, low, high):
        # the device of the parameters this call uses (not next(self.parameters()): a wrapper that
        # flattens parameters leaves the module's parameter list empty)
        device = self.mlps[f"{key}_minus"].w1_raw.device
        if self.key_role(key) != "encoder":  # causal: one branch, future keys as d = 0
            distance = torch.arange(low, high + 1, device=device).neg().clamp(min=0)
            return self.side_bias(f"{key}_minus", distance)
        # d = low .. min(high, 0), then d = max(low, 1) .. high; a side without distances (one token)
        # still runs on none, so that its parameters get a (zero) gradient: DDP sees no unused parameter
        minus_end, plus_start = min(high, 0), max(low, 1)
        minus = torch.arange(low, max(low, minus_end + 1), device=device).neg()
        plus = torch.arange(plus_start, max(plus_start, high + 1), device=device)
        return torch.cat([self.side_bias(f"{key}_minus", minus), self.side_bias(f"{key}_plus", plus)], dim=1)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # checkpoints from before the reparameterisation store gamma itself (used as relu(gamma))
        old, new = prefix + "gammas.", prefix + "raw_gammas."
        for key in [key for key in state_dict if key.startswith(old)]:
            if new + key[len(old):] not in state_dict:
                gamma = state_dict.pop(key)
                state_dict[new + key[len(old):]] = raw_gamma(gamma.float()).to(gamma.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def reset_to_identity(self):
        for mlp in self.mlps.values():
            mlp.reset_to_identity()


@register_encoding("at5_nob")
class AT5NoBuckets(AT5Bias):
    """AT5-NoB: the MLPs read min(|d| / L, 1) directly (no learnable bucketing, no gamma); with
    `--at5-nob-input learned`, sigmoid of a learned scalar per head and clipped relative position."""

    uses_gamma = False

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.inputs = nn.ParameterDict()
        if self.nob_input == "learned":
            self.max_distance = int(self.length_scale)  # positions clipped to +-floor(L)
            rows = {key: self.input_rows(key) for key in self.table_keys()}
            check_size(f"--at5-length-scale {self.length_scale:g}", sum(rows.values()) * dims.heads,
                       "the learned at5_nob input tables")
            for key, count in rows.items():  # the authors' tf.random_uniform_initializer(): U(0, 1)
                self.inputs[key] = nn.Parameter(torch.rand(dims.heads, count))

    def input_rows(self, key):
        """Encoder: d = -M..M; causal decoder: d = -M..0."""
        return 2 * self.max_distance + 1 if self.key_role(key) == "encoder" else self.max_distance + 1

    def directions(self, key):
        if getattr(self, "nob_input", "distance") == "learned":
            return ("both",)  # the authors' code: one MLP per head for every relative position
        return super().directions(key)

    def bucket(self, name, distance):
        dtype = torch.promote_types(self.mlps[name].w1_raw.dtype, torch.float32)
        scaled = (distance.to(dtype) / self.length_scale).clamp(max=1.0)
        return scaled[None, :].expand(self.dims.heads, -1)

    def distance_bias(self, key, low, high):
        if self.nob_input != "learned":
            return super().distance_bias(key, low, high)
        table = self.inputs[key]
        distance = torch.arange(low, high + 1, device=table.device).clamp(-self.max_distance, self.max_distance)
        if self.key_role(key) != "encoder":  # causal: keys after the query (masked) read d = 0
            distance = distance.clamp(max=0)
        return self.mlps[f"{key}_both"](torch.sigmoid(table[:, distance + self.max_distance]))
