"""XL-RPE (Dai et al., 2019) and GCDF-RPE (Qu et al., EMNLP 2021): a fixed prior encoding R_d of
the relative distance d = i - j, projected per layer by W_r, in four logit terms (eq. 8):

    P_ij = (q_i.k_j + q_i.W_r R_{i-j} + u.k_j + v.W_r R_{i-j}) / sqrt(d_head)

u, v in R^{d_head} per head (one pair per stack, shared by its layers, as in Transformer-XL's
default), W_r: d_model -> d_model (= heads x d_head) per layer. XL's R is sinusoidal (eqs. 6-7,
interleaved: R^(2k) = sin(d / 10000^(2k/d_model)), R^(2k+1) = cos(same)); GCDF's is eqs. 14-15,
R_d^k = lambda * Phi(d / sigma_k), sigma_k = d_model^(k/d_model), k = 0..d_model-1, the same
formula for negative d.

Memory: R and W_r R are computed once per forward and layer for the distinct distances of the
call only (Tq + Tk - 1 of them). For consecutive positions the query (plus v) meets them a chunk
of queries at a time, each chunk only the distances its pairs have, read into (B, H, Tq, Tk)
through the strided relative shift (`positions.shifted_product`); other positions: the whole
(B, H, Tq, #distances) product, gathered. On long inputs PositionalAttention calls this one block
of queries at a time (`query_blocks`), never (B, H, n, 2n - 1). No table sized to a maximum
length, no (n, n, d) tensor. Nothing on cross-attention.
"""
import math

import torch
from torch import Tensor, nn

from .base import DistanceLogits, PositionalEncoding, StepTerms, register_encoding
from .option_types import float_in_range, option
from .cache import range_values, signature, use_kept_values
from .positions import bounds, is_range, per_distance, shifted_product, tensor_of

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

    #: PositionalAttention may call the hooks one block of queries at a time (long inputs)
    query_blocks = True

    def spans(self, query_positions, key_positions):
        """(need, span): the distances d = i - j the call's pairs have, and the wider range whose
        projection W_r R is computed once per layer and shared by the calls of a forward pass.
        A call with several queries may be one block of a longer call (PositionalAttention splits
        long inputs): its span is every distance between the keys, the same for every block. A
        single query (a decoding step) needs only its own distances. (Under the future mask,
        `relative_logits` reads d >= -1 only.)"""
        (q_first, q_last), (k_first, k_last) = bounds(query_positions), bounds(key_positions)
        need = (q_first - k_last, q_last - k_first)
        if q_first == q_last:
            return need, need
        return need, (min(need[0], k_first - k_last), max(need[1], k_last - k_first))

    def distances(self, role, query_positions, key_positions):
        """The prior R (N, d_model) of the distances `need[0]..need[1]` the call has, and the
        (Tq, Tk) index of each pair into them."""
        (low, high), _ = self.spans(query_positions, key_positions)
        return self._prior(role, low, high), self._index(role, query_positions, key_positions, low)

    def _prior(self, role, low, high):
        def compute():
            return self.prior(torch.arange(low, high + 1, device=self._device()))
        return self.memoize((role, self.name, "prior", low, high), compute)

    def _index(self, role, query_positions, key_positions, low):
        def compute():
            return tensor_of(query_positions)[:, None] - tensor_of(key_positions)[None, :] - low  # (i - j) - low
        (q_first, _), (k_first, _) = bounds(query_positions), bounds(key_positions)
        return self.memoize((role, self.name, "index", q_first, len(query_positions), k_first, len(key_positions)),
                            compute)

    def _device(self):
        return next(iter(self.projections.values())).weight.device

    def projected(self, role, layer, low, high):
        """W_r R_d of layer `layer` for d = low..high, (high - low + 1, H * D), once per forward."""
        def compute():
            projection = self.projections[f"{role}{layer}"]
            return projection(self._prior(role, low, high).to(projection.weight.dtype))
        return self.memoize((role, self.name, "projected", layer, low, high), compute)

    def projected_step(self, role, layer, low, high, descending=False):
        """`projected` for a decoding step (one query): in inference, a slice of W_r R_d kept
        across steps (positions.py), so a step projects no distance again; else as `projected`.
        `descending`: distances high..low, i.e. the keys' order (no flip per step)."""
        if not use_kept_values(self):
            rel = self.projected(role, layer, low, high)
            return rel.flip(0) if descending else rel
        projection = self.projections._modules[f"{role}{layer}"]  # (once per layer and decoding step)

        def compute(first, last):
            distances = torch.arange(last, first - 1, -1) if descending else torch.arange(first, last + 1)
            prior = self.prior(distances.to(projection.weight.device))
            return projection(prior.to(projection.weight.dtype))
        return range_values(self.cache.inference(self), (role, layer, descending),
                            signature([projection.weight], self.prior_key()), low, high, compute, dim=0,
                            descending=descending)

    def prior_key(self):
        """What the prior R depends on besides the distance (kept values are recomputed on change)."""
        return (self.dims.embed_dim,)

    def position_terms(self, role, layer, query, key, query_positions, key_positions, content=True,
                       descending=False):
        """(rel, query + v, content) of a call: rel = W_r R_d (H, N, D) over d = i - j = low..high
        (ascending; `descending`: high..low), the query plus v, and u.k_j (B, H, 1, Tk; None unless
        `content`); u and v scaled as the query."""
        heads, tq, head_dim = query.shape[1:]
        (low, high), (span_low, span_high) = self.spans(query_positions, key_positions)
        if tq == 1:  # a decoding step
            rel = self.projected_step(role, layer, low, high, descending)
        elif descending:
            # flipped once per layer, each head's distances contiguous (BLAS reads them without a
            # copy; docs/benchmarks.md): each block of queries takes a view
            def per_head():
                flipped = self.projected(role, layer, span_low, span_high).flip(0)
                return flipped.view(-1, heads, head_dim).transpose(0, 1).contiguous()
            flipped = self.memoize((role, self.name, "projected descending", layer, span_low, span_high), per_head)
            rel = flipped[:, span_high - high: span_high - low + 1].to(query.dtype)  # (H, N, D)
        else:
            rel = self.projected(role, layer, span_low, span_high)[low - span_low: high - span_low + 1]
        if rel.dim() == 2:
            rel = rel.to(query.dtype).view(-1, heads, head_dim).transpose(0, 1)  # (H, N, D) = W_r R_d, d = low..high
        u, v = self.scaled_biases(role, query.dtype)
        return rel, query + v, (key @ u).transpose(-1, -2) if content else None  # u.k_j (B, H, 1, Tk)

    def scaled_biases(self, role, dtype):
        """u as (H, D, 1) and v as (1, H, 1, D), scaled by 1/sqrt(D) as the query arrives: once per
        forward (a decoding step: once per step, not per layer); in inference kept across steps
        while u and v stay as they are."""
        def compute():
            scale = self.dims.head_dim ** -0.5
            u = self.content_bias[role].to(dtype) * scale
            v = self.position_bias[role].to(dtype) * scale
            return u[:, :, None], v[None, :, None, :]

        def kept():
            if not use_kept_values(self):
                return compute()
            depends_on = signature([self.content_bias[role], self.position_bias[role]], dtype)
            return self.cache.inference_value(self, ("u v", role), depends_on, compute)
        return self.memoize((role, self.name, "u v", dtype), kept)

    def relative_logits(self, role, layer, query, key, query_positions, key_positions, future_blocked=False,
                        content_folded=False):
        """(q_i + v).W_r R_{i-j} + u.k_j, or the first term alone with `content_folded` (the attention
        computes (q + u).k_j: `content_query`)."""
        if role not in SELF_ROLES:
            return None
        batch, heads, tq, _ = query.shape
        if tq == 1 and is_range(key_positions):
            return self.step_logits(role, layer, query, key, query_positions, key_positions, content_folded)
        ranges = is_range(query_positions) and is_range(key_positions)
        rel, query_v, content = self.position_terms(role, layer, query, key, query_positions, key_positions,
                                                    content=not content_folded, descending=ranges)
        if ranges:
            if future_blocked and rel.size(1) > key.size(2) + 1:
                rel = rel[:, :key.size(2) + 1]  # distances high..-1: under the future mask the rest is blocked
            position = shifted_product(query_v, rel, key.size(2))  # rel over d = high..low
        else:
            low = self.spans(query_positions, key_positions)[0][0]
            index = self._index(role, query_positions, key_positions, low)  # (Tq, Tk)
            position = query_v @ rel.transpose(-1, -2)[None]  # (B, H, Tq, N)
            position = position.gather(-1, index.expand(batch, heads, tq, index.size(-1)))
        return position if content_folded else position + content

    def content_query(self, role, layer, dtype):
        if role not in SELF_ROLES:
            return None
        return self.scaled_biases(role, dtype)[0].transpose(1, 2)  # u, (H, 1, D)

    def step_terms(self, role, layer, query_positions, key_positions):
        """One query in inference, as additions to plain attention's inputs (`StepTerms`):

            e_j = (q + u) . k_j + (q + v) . r_j = (q + u) . (k_j + r_j) + (v - u) . r_j,  r_j = W_r R_{i-j}

        the query plus u against the keys plus r, and (v - u) . r_j per head and distance, kept with
        r across steps for every layer of the stack together (`_step_rows`: a slice per step, shared
        by the layers, in the keys' order). Training keeps the hooks."""
        if role not in SELF_ROLES or not use_kept_values(self) or len(query_positions) != 1 or not is_range(key_positions):
            return None
        (low, high), _ = self.spans(query_positions, key_positions)
        keys, logits, query = self.memoize((role, self.name, "step", low, high), lambda: self._step_rows(role, low, high))
        return StepTerms(query=query, keys=keys[layer], logits=logits[layer])

    def _step_rows(self, role, low, high):
        """A decoding step's terms of every layer of the stack, for the distances high..low: r
        (L, H, N, D), (v - u).r (L, H, 1, N) and u (H, 1, D), scaled as the queries arrive; r and
        (v - u).r kept across steps (`range_values`) while W_r, u and v hold."""
        heads, head_dim = self.dims.heads, self.dims.head_dim
        projections = [self.projections._modules[f"{role}{layer}"] for layer in range(self.dims.layers(role))]
        u, v = self.content_bias[role], self.position_bias[role]  # (H, D)
        dtype, scale = projections[0].weight.dtype, head_dim ** -0.5

        def compute(first, last):
            distances = torch.arange(last, first - 1, -1, device=u.device)  # descending: the keys' order
            prior = self.prior(distances).to(dtype)
            rel = torch.stack([projection(prior) for projection in projections]).view(len(projections), -1, heads, head_dim)
            shift = (rel * ((v - u) * scale).to(dtype)).sum(-1, keepdim=True)  # (L, N, H, 1)
            return torch.cat([rel, shift], dim=3).transpose(1, 2).contiguous()  # (L, H, N, D + 1)
        depends_on = signature([*(projection.weight for projection in projections), u, v], self.prior_key())
        kept = range_values(self.cache.inference(self), (role, "step"), depends_on, low, high, compute, dim=2, descending=True)
        return kept.narrow(3, 0, head_dim), kept.select(3, head_dim).unsqueeze(2), self.content_query(role, None, dtype)

    def step_logits(self, role, layer, query, key, query_positions, key_positions, content_folded=False):
        """`relative_logits` of one query (a decoding step) against consecutive keys: the kept W_r R
        in descending distance, i.e. the keys' order, so no gather; the heads' queries (plus v) as
        the rows of one batched product per head, with u.k_j as its input (the fewest operations:
        a step pays per operation, and broadcasting the batch through matmul costs more)."""
        batch, heads, _, head_dim = query.shape
        (low, high), _ = self.spans(query_positions, key_positions)
        rel = self.projected_step(role, layer, low, high, descending=True).to(query.dtype)  # (Tk, H * D)
        u, v = self.scaled_biases(role, query.dtype)
        rows = (query + v).reshape(batch, heads, head_dim).transpose(0, 1)  # (H, B, D)
        rel = rel.view(-1, heads, head_dim).permute(1, 2, 0)  # (H, D, Tk)
        if content_folded:
            logits = torch.bmm(rows, rel)
        else:
            content = (key * u.view(1, heads, 1, head_dim)).sum(-1)  # u.k_j, (B, H, Tk)
            logits = torch.baddbmm(content.transpose(0, 1), rows, rel)
        return logits.transpose(0, 1).unsqueeze(2)  # (B, H, 1, Tk)

    def distance_logits(self, role, layer, query, key, query_positions, key_positions):
        """(query + v) against W_r R of every distance of the call, (B, H, Tq, Tq + Tk - 1): O(n^2)
        like the logits (about twice their size at Tq = Tk), unlike the other encodings' tables; and u.k_j."""
        if role not in SELF_ROLES:
            return None
        rel, query_v, content = self.position_terms(role, layer, query, key, query_positions, key_positions,
                                                    descending=True)
        return DistanceLogits(per_distance(query_v, rel), key_bias=content[:, :, 0])  # d = high..low

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
        self.scale = option(args, "gcdf_lambda", lambda_type, 4.0)

    @staticmethod
    def add_args(parser):
        parser.add_argument("--gcdf-lambda", type=lambda_type, metavar="L",
                            help="gcdf: scale factor lambda of the prior R_d^k = lambda * Phi(d / sigma_k), "
                                 f"0 < L <= {MAX_LAMBDA:g} (default 4)")

    def prior(self, distances):
        return gcdf_prior(distances, self.dims.embed_dim, self.scale)

    def prior_key(self):
        return (self.dims.embed_dim, self.scale)
