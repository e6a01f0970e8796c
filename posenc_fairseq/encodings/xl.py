"""XL-RPE (Dai et al., 2019) and GCDF-RPE (Qu et al., EMNLP 2021): a fixed prior encoding R_d of
the relative distance d = i - j, projected per layer by W_r, in four logit terms (eq. 8):

    P_ij = (q_i.k_j + q_i.W_r R_{i-j} + u.k_j + v.W_r R_{i-j}) / sqrt(d_head)

u, v in R^{d_head} per head (one pair per stack, shared by its layers, as in Transformer-XL's
default), W_r: d_model -> d_model (= heads x d_head) per layer. XL's R is sinusoidal (eqs. 6-7,
interleaved: R^(2k) = sin(d / 10000^(2k/d_model)), R^(2k+1) = cos(same)); GCDF's is eqs. 14-15,
R_d^k = lambda * Phi(d / sigma_k), sigma_k = d_model^(k/d_model), k = 0..d_model-1, the same
formula for negative d.

The term (`DistanceTerm`, distance.py): W_r R of each distance of the call (Tq + Tk - 1 of them,
computed once per forward and layer), the query shift v and the content u. The query (plus v)
meets them a chunk of queries at a time, each chunk only the distances its pairs have
(`positions.shifted_product`); on long inputs a block of queries at a time, never (B, H, n, 2n - 1).
No table sized to a maximum length, no (n, n, d) tensor. Nothing on cross-attention.
"""
import math

import torch
from torch import Tensor, nn

from .base import PositionalEncoding, register_encoding
from .distance import DistanceTerm
from .option_types import float_in_range
from .cache import range_values, use_kept_values

#: lambda of eq. 15: positive (0 removes the position term, a negative one only flips its sign);
#: bounded so that lambda * W_r R stays far from float16/float32 overflow
MAX_LAMBDA = 1e4
lambda_type = float_in_range(0.0, MAX_LAMBDA, low_open=True)
SELF_ROLES = ("encoder", "decoder")


def sinusoidal_prior(distances: Tensor, d_model: int) -> Tensor:
    """Eqs. 6-7: (N,) distances -> (N, d_model), sin in even and cos in odd dimensions."""
    pair = torch.arange(0, d_model, 2, dtype=torch.float64, device=distances.device)  # 2k
    angles = distances.to(torch.float64)[:, None] / torch.pow(10000.0, pair / d_model)[None, :]
    prior = torch.empty(len(distances), d_model, dtype=torch.float64, device=distances.device)
    prior[:, 0::2] = torch.sin(angles)
    prior[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return prior


def gcdf_prior(distances: Tensor, d_model: int, scale: float = 4.0) -> Tensor:
    """Eqs. 14-15: R_d^k = lambda * Phi(d / sigma_k), sigma_k = d_model^(k / d_model)."""
    k = torch.arange(d_model, dtype=torch.float64, device=distances.device)
    sigma = torch.pow(float(d_model), k / d_model)
    x = distances.to(torch.float64)[:, None] / sigma[None, :]
    return scale * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


@register_encoding("xl")
class TransformerXL(PositionalEncoding):
    default_input_positions = "none"

    def __init__(self, args, dims):
        super().__init__(args, dims)
        heads, head_dim, d_model = dims.heads, dims.head_dim, dims.embed_dim
        self.projections = nn.ModuleDict()  # W_r, one per self-attention layer
        self.content_bias = nn.ParameterDict()  # u, (H, D) per stack
        self.position_bias = nn.ParameterDict()  # v, (H, D) per stack
        for role in SELF_ROLES:
            layers = dims.layers(role)
            if layers == 0:
                continue
            for layer in range(layers):
                self.projections[f"{role}{layer}"] = nn.Linear(d_model, heads * head_dim, bias=False)
            self.content_bias[role] = nn.Parameter(torch.randn(heads, head_dim) * 0.02)
            self.position_bias[role] = nn.Parameter(torch.randn(heads, head_dim) * 0.02)

    def prior(self, distances: Tensor) -> Tensor:
        return sinusoidal_prior(distances, self.dims.embed_dim)

    def distance_term(self, role, layer, low, high, queries, dtype):
        """(q_i + v).W_r R_{i-j} + u.k_j: W_r R of each distance d = j - i = low..high per head, the
        query shift v and the content u. A decoding step in inference: its form (q + u).(k_j + r_j)
        + (v - u).r_j, kept across steps and decodes (`_step_terms`)."""
        if role not in SELF_ROLES:
            return None
        if queries == 1 and use_kept_values(self):
            return self._step_terms(role, low, high)[layer]
        u, v = self.scaled_biases(role, dtype)
        return DistanceTerm(low, high, vectors=self.projected(role, layer, low, high, dtype), shift=v, content=u)

    def _prior(self, role, low, high):
        """R_{i-j} (N, d_model) of the key - query distances j - i = low..high, once per forward."""
        def compute():
            return self.prior(torch.arange(-low, -high - 1, -1, device=self._device()))
        return self.memoize(self.term_key(role, "prior", low, high), compute)

    def _device(self):
        return next(iter(self.projections.values())).weight.device

    def projected(self, role, layer, low, high, dtype):
        """W_r R_{i-j} of layer `layer` for j - i = low..high, (H, N, D) in `dtype`, each head's
        distances contiguous (BLAS reads them without a copy; docs/benchmarks.md), once per forward."""
        def compute():
            projection = self.projections[f"{role}{layer}"]
            vectors = projection(self._prior(role, low, high).to(projection.weight.dtype)).to(dtype)
            return vectors.view(-1, self.dims.heads, self.dims.head_dim).transpose(0, 1).contiguous()
        return self.memoize(self.term_key(role, "projected", layer, low, high, dtype), compute)

    def prior_key(self):
        """What the prior R depends on besides the distance (kept values are recomputed on change)."""
        return (self.dims.embed_dim,)

    def scaled_biases(self, role, dtype):
        """u and v as (H, 1, D), scaled by 1/sqrt(D) as the query arrives: once per forward; in
        inference kept across passes."""
        def compute():
            return self._scaled(self.content_bias[role], dtype), self._scaled(self.position_bias[role], dtype)

        def kept():
            if not use_kept_values(self):
                return compute()
            return self.cache.inference_value(self, self.term_key(role, "u v"), (dtype,), compute)
        return self.memoize(self.term_key(role, "u v", dtype), kept)

    def _scaled(self, bias, dtype):
        """u or v (H, D) as (H, 1, D) in `dtype`, scaled by 1/sqrt(D) as the queries arrive."""
        return (bias.to(dtype) * self.dims.head_dim ** -0.5)[:, None, :]

    def _step_terms(self, role, low, high):
        """Each layer's term of a decoding step for the distances j - i = low..high (the keys'
        order) in the step's form: r = W_r R (H, N, D) as `vectors`, (v - u).r (H, N) as `bias`
        and u (H, 1, D) as `shift` and `content`, scaled as the queries arrive, in the parameters'
        dtype. The rows of every layer are kept (`range_values`) and so are the terms made of each
        slice: a step computes nothing."""
        heads, head_dim = self.dims.heads, self.dims.head_dim

        def rows(first, last):  # (L, H, N, D + 1): r and (v - u).r of every layer
            projections = [self.projections[f"{role}{layer}"] for layer in range(self.dims.layers(role))]
            u, v = self.content_bias[role], self.position_bias[role]
            dtype = projections[0].weight.dtype
            prior = self.prior(torch.arange(-first, -last - 1, -1, device=u.device)).to(dtype)
            vectors = torch.stack([projection(prior) for projection in projections]).view(len(projections), -1, heads, head_dim)
            shift = (vectors * ((v - u) * head_dim ** -0.5).to(dtype)).sum(-1, keepdim=True)  # (L, N, H, 1)
            return torch.cat([vectors, shift], dim=3).transpose(1, 2).contiguous()

        def terms(step_rows):
            u = self._scaled(self.content_bias[role], step_rows.dtype)
            return [DistanceTerm(low, high, bias=layer_rows[..., head_dim], vectors=layer_rows[..., :head_dim],
                                 shift=u, content=u) for layer_rows in step_rows.unbind(0)]
        return range_values(self.cache.inference(self), self.term_key(role, "step terms"), self.prior_key(),
                            low, high, rows, dim=2, derive=terms)

    def reset_to_identity(self):
        with torch.no_grad():
            for projection in self.projections.values():
                projection.weight.zero_()
            for u in self.content_bias.values():
                u.zero_()


@register_encoding("gcdf")
class GCDF(TransformerXL):
    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.scale = self.defining_option(args, "gcdf_lambda", lambda_type, 4.0)

    @staticmethod
    def add_args(parser):
        parser.add_argument("--gcdf-lambda", type=lambda_type, metavar="L",
                            help="gcdf: scale factor lambda of the prior R_d^k = lambda * Phi(d / sigma_k), "
                                 f"0 < L <= {MAX_LAMBDA:g} (default 4)")

    def prior(self, distances):
        return gcdf_prior(distances, self.dims.embed_dim, self.scale)

    def prior_key(self):
        return (self.dims.embed_dim, self.scale)
