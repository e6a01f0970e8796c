"""T5's scalar relative position bias (Raffel et al., 2020) as analysed by Wu et al. (AAAI 2021),
and its no-bucket ablation T5-NoB.

Every head h adds a learned scalar e_h(l) to the scaled logit of query i and key j, where
l = j - i (key position minus query position; paper eqs. 5 and 13):

    alpha_ij = softmax_j( q_i . k_j / sqrt(d) + e_h(j - i) )

T5:      e_h(l) = E[b(l), h], b the fixed bucketing function (paper eqs. 14-16, the algorithm of
         HuggingFace's `T5Attention._relative_position_bucket`, see `relative_position_bucket`):
         bidirectional buckets in the encoder, causal buckets in the decoder self-attention.
T5-NoB:  e_h(l) = E[clip(l, -M, M) + M, h] (bidirectional) or E[min(max(-l, 0), M), h]
         (causal): one scalar per clipped distance, no buckets.

Cross-attention gets no bias. By default only the first layer of each stack has a table
(`--scalar-bias-layers first`, the paper's MT/classification runs); with `all` every layer gets
one, shared by all layers of a stack with `--scalar-bias-share-layers` or one per layer without.
The bias is computed once per forward over the distinct distances and gathered into
(heads, q_len, k_len); layers that share a table share that tensor. A decoding step (one query,
the last position) reads its bias as a slice of the per-distance values, which inference keeps
across steps (positions.py): no per-step bucketing, no gather, no device synchronisation.

The prior beta of paper eq. 6 (softmax over keys of the bias): `prior.prior_distribution`.

Options are checked where they are parsed and again where the encoding is built (see
option_types.py): `--t5-num-buckets` must be even (eq. 14 splits the buckets between the two
directions), 0 is honoured where it means something (`--t5-max-distance 0` for t5_nob clips every
distance to 0) and refused where it does not.
"""
import argparse
import math

import torch
from torch import Tensor, nn

from .base import PositionalEncoding, register_encoding
from .distance import DistanceTerm
from .option_types import OptionValueError, check_size, even_int_in_range, flag, int_in_range, one_of, option
from .cache import range_values, use_kept_values

#: parse-time bounds; beyond them a table would be absurdly large (build time checks the exact size)
MAX_BUCKETS = 2 ** 20
MAX_T5_DISTANCE = 2 ** 20
num_buckets_type = even_int_in_range(4, MAX_BUCKETS)
max_distance_type = int_in_range(0, MAX_T5_DISTANCE)
bias_layers_type = one_of("first", "all")


def relative_position_bucket(relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32,
                             max_distance: int = 128) -> Tensor:
    """T5's bucket of each relative position (same shape, int64); element for element identical to
    HuggingFace transformers' `T5Attention._relative_position_bucket` (same float32 operations).

    `relative_position` = key position - query position (any-shape LongTensor). With S buckets on
    the side the distance falls on and n the distance on that side,

        bidirectional: S = num_buckets // 2, n = |rp|, and buckets of rp > 0 are offset by S;
        causal:        S = num_buckets,      n = max(-rp, 0)   (future keys share bucket 0);
        max_exact = S // 2
        bucket(n) = n                                                                if n < max_exact
                  = min(max_exact + trunc(log(n / max_exact) / log(max_distance / max_exact)
                                          * (S - max_exact)),  S - 1)                otherwise

    i.e. exact buckets for small distances, logarithmically wider ones up to `max_distance`, and
    every distance >= max_distance in the last bucket of its side (paper eqs. 14-16 with
    B_max = num_buckets and M = max_distance). As in HF, `max_distance` must exceed `max_exact`
    for the logarithmic part to be meaningful (otherwise the ids are HF's, i.e. garbage).
    """
    relative_position = relative_position.long()
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    if_large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, if_large)


def _add_once(parser: argparse.ArgumentParser, name: str, **kwargs):
    """Encodings of one family share options; every encoding's add_args runs on the same parser."""
    if name not in parser._option_string_actions:
        parser.add_argument(name, **kwargs)


def add_scalar_bias_args(parser: argparse.ArgumentParser):
    """Options common to T5, T5-NoB, AT5 and AT5-NoB."""
    _add_once(parser, "--scalar-bias-layers", choices=("first", "all"),
              help="t5/t5_nob/at5/at5_nob: add the scalar position bias in the first layer of each stack "
                   "(paper's MT and classification runs) or in every layer (its QA runs); default first")
    _add_once(parser, "--scalar-bias-share-layers", action="store_true",
              help="t5/t5_nob/at5/at5_nob with --scalar-bias-layers all: one table (T5) or one set of "
                   "gamma/MLP (AT5) per stack shared by all its layers (HF T5's layout) instead of one per layer")


class ScalarBias(PositionalEncoding):
    """Common machinery: which (role, layer) gets a bias, which parameter set it uses, computing
    the bias once per forward over the distinct distances and gathering it."""

    default_input_positions = "none"  # the paper's T5/AT5 runs use no absolute input embedding

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.bias_layers = self.defining_option(args, "scalar_bias_layers", bias_layers_type, "first")
        self.share_layers = option(args, "scalar_bias_share_layers", flag, False)
        if self.bias_layers == "first":
            self.not_read(args, "scalar_bias_share_layers", "it shares the tables of --scalar-bias-layers all")

    # --- layout ---------------------------------------------------------------------------
    @classmethod
    def depth_changed_by_pruning(cls, args, role, kept):
        if getattr(args, "scalar_bias_layers", None) in (None, "first") and role in ("encoder", "decoder") and kept[0] != 0:
            return (f"--scalar-bias-layers first gives the bias to the {role}'s first layer: without layer 0 it would "
                    f"move to layer {kept[0]}")
        return None

    def has_bias(self, role: str, layer: int) -> bool:
        return role in ("encoder", "decoder") and layer < self.dims.layers(role) and \
            (self.bias_layers == "all" or layer == 0)

    def table_key(self, role: str, layer: int) -> str:
        """Name of the parameter set (role, layer) uses: one per stack when only the first layer
        has a bias or tables are shared, else one per layer."""
        if self.bias_layers == "first" or self.share_layers:
            return role
        return f"{role}_{layer}"

    def table_keys(self):
        """Every parameter set that some layer uses (and only those: unused parameters break DDP)."""
        keys = []
        for role in ("encoder", "decoder"):
            for layer in range(self.dims.layers(role)):
                if self.has_bias(role, layer) and self.table_key(role, layer) not in keys:
                    keys.append(self.table_key(role, layer))
        return keys

    @staticmethod
    def key_role(key: str) -> str:
        return key.split("_")[0]

    # --- the bias -------------------------------------------------------------------------
    def distance_bias(self, key: str, low: int, high: int) -> Tensor:
        """(heads, high - low + 1) bias of the relative positions (key - query) low, low+1, ..., high
        for parameter set `key`; subclasses implement it."""
        raise NotImplementedError

    def bias_options(self) -> tuple:
        """The options `distance_bias` reads besides the parameters: a kept bias is recomputed when
        they change."""
        return ()

    def distance_values(self, key: str, low: int, high: int) -> Tensor:
        """`distance_bias`, kept across calls in inference (positions.py: a decoding step reads a
        slice of it)."""
        if use_kept_values(self):
            kept_key = self.term_key(self.key_role(key), "per distance", key)
            return range_values(self.cache.inference(self), kept_key, self.bias_options(),
                                low, high, lambda a, b: self.distance_bias(key, a, b), dim=1)
        return self.distance_bias(key, low, high)

    def distance_term(self, role, layer, low, high, queries, dtype):
        """The bias per distance itself, once per forward and table (a decoding step: a slice of the
        values kept across steps)."""
        if not self.has_bias(role, layer):
            return None
        name = self.table_key(role, layer)
        values = self.memoize(self.term_key(role, "per distance", name, low, high),
                              lambda: self.distance_values(name, low, high))
        return DistanceTerm(low, high, bias=values, key=self.term_key(role, "per distance", name))


class _TableBias(ScalarBias):
    """One learned (rows, heads) table per parameter set; `rows_of` maps distances to rows."""

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.max_distance = self.defining_option(args, "t5_max_distance", max_distance_type, 128)
        self.check_options()
        rows = sum(self.rows(self.key_role(key) == "encoder") for key in self.table_keys())
        check_size(self.size_option(), rows * dims.heads, f"the {self.name} bias tables")
        self.tables = nn.ParameterDict({
            key: nn.Parameter(torch.empty(self.rows(self.key_role(key) == "encoder"), dims.heads))
            for key in self.table_keys()})
        for table in self.tables.values():
            # HF T5's initialisation of relative_attention_bias (factor 1): N(0, d_model^-1/2)
            nn.init.normal_(table, std=dims.embed_dim ** -0.5)

    @staticmethod
    def add_args(parser):
        add_scalar_bias_args(parser)
        _add_once(parser, "--t5-num-buckets", type=num_buckets_type, metavar="N",
                  help=f"t5: number of buckets B_max, even (half per direction in the encoder), 4..{MAX_BUCKETS}; "
                       "default 32 (the paper's MT runs: 64)")
        _add_once(parser, "--t5-max-distance", type=max_distance_type, metavar="M",
                  help="t5: distance M from which all distances share the last bucket (must exceed B_max/2); "
                       f"t5_nob: distances are clipped to +-M (0 allowed); 0..{MAX_T5_DISTANCE}; default 128")

    def check_options(self) -> None:
        """Refuse (OptionValueError) options that do not fit together, before the tables are made."""

    def rows(self, bidirectional: bool) -> int:
        raise NotImplementedError

    def size_option(self) -> str:
        """The option(s) that size the tables, as the user gave them (for the size error)."""
        return f"--t5-max-distance {self.max_distance}"

    def bias_options(self):
        return (self.max_distance,)

    def rows_of(self, distances: Tensor, bidirectional: bool) -> Tensor:
        raise NotImplementedError

    def distance_bias(self, key, low, high):
        table = self.tables[key]
        distances = torch.arange(low, high + 1, device=table.device)
        rows = self.rows_of(distances, bidirectional=self.key_role(key) == "encoder")
        # gathered from a float32 copy in fp16/bf16: the backward sums the gradients of a row's distances
        # (thousands share the far rows), which index_put would round at every add in half precision
        return table.to(torch.promote_types(table.dtype, torch.float32))[rows].t().to(table.dtype)  # (heads, D)

    def reset_to_identity(self):
        with torch.no_grad():
            for table in self.tables.values():
                table.zero_()


@register_encoding("t5")
class T5Bias(_TableBias):
    """T5: e_h(l) = E[b(l), h] with T5's fixed buckets (paper eqs. 14-16)."""

    def __init__(self, args, dims):
        self.num_buckets = self.defining_option(args, "t5_num_buckets", num_buckets_type, 32)
        super().__init__(args, dims)

    def check_options(self):
        if self.max_distance <= self.num_buckets // 2:  # the causal side's exact buckets (the larger)
            raise OptionValueError(
                f"--t5-max-distance {self.max_distance}: expected an integer > {self.num_buckets // 2} "
                f"(half of --t5-num-buckets {self.num_buckets}: distances below it have exact buckets)")

    def rows(self, bidirectional):
        return self.num_buckets

    def size_option(self):
        return f"--t5-num-buckets {self.num_buckets}"

    def bias_options(self):
        return (self.num_buckets, self.max_distance)

    def rows_of(self, distances, bidirectional):
        return relative_position_bucket(distances, bidirectional, self.num_buckets, self.max_distance)


@register_encoding("t5_nob")
class T5NoBuckets(_TableBias):
    """T5-NoB: one scalar per relative distance clipped to +-M (causal: 0..M), no buckets."""

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.not_read(args, "t5_num_buckets", "t5_nob has no buckets")

    def rows(self, bidirectional):
        return 2 * self.max_distance + 1 if bidirectional else self.max_distance + 1

    def rows_of(self, distances, bidirectional):
        if bidirectional:
            return distances.clamp(-self.max_distance, self.max_distance) + self.max_distance
        return (-distances).clamp(0, self.max_distance)
