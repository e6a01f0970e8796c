"""Shaw-RPE (Shaw et al., 2018) and LFHC-RPE (Qu et al., EMNLP 2021): learned relative embeddings
added to the keys (and optionally the values) of self-attention.

    e_ij = q_i . (k_j + a^K_ij) / sqrt(d_head)        z_i = sum_j alpha_ij (v_j + a^V_ij)
    Shaw:  a^K_ij = w^K[clip(j - i, k)],  a^V_ij = w^V[clip(j - i, k)],  w^K, w^V in R^{(2k+1) x d_head}

one table pair per self-attention layer, shared by the heads. Shaw indexes by key - query
(j - i, Shaw et al. 2018) and keeps its value term by default (their full model). LFHC follows
Qu et al.: eq. 5 indexes by x = i - j (query - key) and has the key term only (the value term
is an extension, `--lfhc-values on`), and eq. 9 replaces clip at layer l (counted from 1, so
layer 1 is Shaw up to the sign of the index):

    clip^l(x, k) = k if x > kl;  floor(x / l) if -kl <= x <= kl;  -k if x < -kl,   x = i - j

taken literally, i.e. floor also for negative x (the paper prints the branches x >= 0 and x < 0
separately but identically; `--lfhc-rounding trunc` is the symmetric reading, truncation
toward zero). Same number of parameters as Shaw.

The terms (`DistanceTerm`, distance.py) are the table rows the call's distances use (at most
Tq + Tk - 1 of the 2k+1) and the row of each distance as runs (the two clipped ends and the band
between them): the query meets the rows once, (B, H, Tq, #rows), repeated per run and laid out as
(B, H, Tq, Tk) by a strided view; the value term sums the probabilities per run before multiplying
by w^V. Never an (n, n, d_head) tensor; on long inputs a block of queries at a time. Nothing on
cross-attention; nothing sized to a maximum length, so a large k costs parameters only.
"""

import torch
from torch import Tensor, nn

from .base import PositionalEncoding, register_encoding
from .distance import DistanceTerm
from .option_types import Checker, check_size, checked, flag, one_of
from .cache import range_values, use_kept_values
from .positions import row_runs, tensor_of

SELF_ROLES = ("encoder", "decoder")
#: parse-time bound of k (2k+1 table rows per layer); build time checks the exact table size
MAX_K = 2 ** 16
k_type = Checker(int, 1, MAX_K, name="k")
ROUNDINGS = ("floor", "trunc")


def shaw_buckets(relative: Tensor, k: int) -> Tensor:
    """clip(x, k) = max(-k, min(k, x)), shifted to 0..2k (table rows)."""
    return relative.clamp(-k, k) + k


def lfhc_buckets(relative: Tensor, k: int, layer: int, rounding: str = "floor") -> Tensor:
    """Eq. 9 at 1-based layer `layer` of x = `relative`, shifted to 0..2k. floor(x / l) for both
    signs (literal), or with rounding='trunc' truncation toward zero (the symmetric reading)."""
    return torch.div(relative, layer, rounding_mode=rounding).clamp(-k, k) + k


@register_encoding("shaw")
class Shaw(PositionalEncoding):
    default_input_positions = "none"  # Shaw et al.: no sinusoidal input encoding in addition
    option_prefix = "shaw"
    default_values = True  # Shaw et al.'s full model has the value term

    def __init__(self, args, dims):
        super().__init__(args, dims)
        prefix = self.option_prefix.replace("-", "_")
        self.k = self.defining_option(args, f"{prefix}_k", k_type, 16)
        values = getattr(args, f"{prefix}_values", None)
        self.values = self.default_values if values is None else checked(f"{prefix}_values", values, flag)
        tables = (2 if self.values else 1) * (dims.encoder_layers + dims.decoder_layers)
        check_size(f"--{self.option_prefix}-k {self.k}", tables * (2 * self.k + 1) * dims.head_dim,
                   f"the {self.name} relative embedding tables")
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
        parser.add_argument(f"--{p}-k", type=k_type, metavar="K",
                            help=f"{cls.name}: maximum clipped relative distance k, 1..{MAX_K}; 2k+1 embeddings "
                                 "per layer (default 16)")
        if cls.default_values:
            values_help = f"{cls.name}: also add a^V_ij to the values (default on, as in Shaw et al.'s full model; " \
                          "they found it unnecessary for MT)"
        else:
            values_help = f"{cls.name}: also add a^V_ij to the values (default off: Qu et al.'s eqs. 5 and 9 have " \
                          "the key term only; on is an extension, Shaw et al.'s value term)"
        parser.add_argument(f"--{p}-values", type=flag, metavar="on|off", help=values_help)

    # --- rows ----------------------------------------------------------------------------------
    def bucket_of(self, query_positions: Tensor, key_positions: Tensor, layer: int) -> Tensor:
        """(Tq, Tk) table rows (0..2k) at 0-based `layer`: Shaw's clip(j - i, k) + k."""
        return shaw_buckets(tensor_of(key_positions)[None, :] - tensor_of(query_positions)[:, None], self.k)

    def row_bounds(self, low: int, high: int, layer: int):
        """Lowest and highest row of the key - query distances low..high, in Python integers:
        clip(j - i, k) + k is monotone in j - i."""
        return max(-self.k, min(self.k, low)) + self.k, max(-self.k, min(self.k, high)) + self.k

    def rows_of_distances(self, layer: int, low: int, high: int, device) -> Tensor:
        """Table rows (0..2k) of the key - query distances low..high (ascending)."""
        x = torch.arange(-low, -high - 1, -1, device=device)  # query - key
        return self.bucket_of(x, torch.zeros(1, dtype=x.dtype, device=x.device), layer)[:, 0]

    def _layer_key(self, layer):
        return 0  # Shaw: the same rows at every layer

    def row_options(self) -> tuple:
        """The options `rows_of_distances` reads: rows kept across decoding steps follow them."""
        return (self.k,)

    def distance_runs(self, role: str, layer: int, low: int, high: int):
        """(runs, first, last): the rows first..last that the distances low..high use, and the row
        of each distance - first as `row_runs` pieces (Python integers, computed on the host: no
        device synchronisation), once per forward."""
        def compute():
            first, last = self.row_bounds(low, high, layer)
            rows = self.rows_of_distances(layer, low, high, "cpu") - first
            return tuple(row_runs(rows.tolist())), first, last
        return self.memoize(self.term_key(role, "distance runs", self._layer_key(layer), low, high), compute)

    # --- hooks ----------------------------------------------------------------------------------
    def distance_term(self, role, layer, low, high, queries, dtype):
        """w^K of each distance: q_i . a^K_ij (the query already scaled by 1/sqrt(d))."""
        return self._term(role, layer, "key", low, high, queries, dtype) if role in SELF_ROLES else None

    def value_term(self, role, layer, low, high, queries, dtype):
        """w^V of each distance: sum_j alpha_ij a^V_ij."""
        if not (self.values and role in SELF_ROLES):
            return None
        return self._term(role, layer, "value", low, high, queries, dtype)

    def _term(self, role, layer, which, low, high, queries, dtype):
        """The rows of the layer's `which` ('key' or 'value') table that the distances low..high use,
        one (D,) vector per row shared by the heads. A decoding step in inference: the row of each
        distance itself, kept across steps (`range_values`: a slice per step)."""
        table = (self.key_tables if which == "key" else self.value_tables)[f"{role}{layer}"]
        if queries == 1 and use_kept_values(self):
            def compute(first, last):
                return table.index_select(0, self.rows_of_distances(layer, first, last, table.device))
            kept_key = self.term_key(role, "rows per distance", layer, which)
            rows = range_values(self.cache.inference(self), kept_key, self.row_options(), low, high, compute, dim=0)
            return DistanceTerm(low, high, vectors=rows.to(dtype)[None])
        runs, first, last = self.distance_runs(role, layer, low, high)
        return DistanceTerm(low, high, vectors=table[first: last + 1].to(dtype)[None], rows=runs)

    def reset_to_identity(self):
        with torch.no_grad():
            for table in list(self.key_tables.values()) + list(self.value_tables.values()):
                table.zero_()


@register_encoding("lfhc")
class LFHC(Shaw):
    """Qu et al.'s LFHC-RPE: eq. 9's layer-dependent clip of x = i - j (layer l, 1-based, buckets
    floor(x / l)), key term only by default (eqs. 5 and 9)."""

    option_prefix = "lfhc"
    default_values = False

    def __init__(self, args, dims):
        super().__init__(args, dims)
        self.rounding = self.defining_option(args, "lfhc_rounding", one_of(*ROUNDINGS), "floor")

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--lfhc-rounding", choices=ROUNDINGS,
                            help="lfhc: floor(x/l) for both signs of x = i - j (eq. 9 as printed, default) or trunc "
                                 "(truncation toward zero: a symmetric reading of eq. 9's two identical branches)")

    @classmethod
    def depth_changed_by_pruning(cls, args, role, kept):
        moved = [layer for new, layer in enumerate(kept) if new != layer]
        if role in SELF_ROLES and moved:
            return (f"LFHC's coarse-graining l (eq. 9) is the layer's depth: {role} layer {moved[0]} would run at "
                    f"depth {kept.index(moved[0])} (a prefix of the layers, 0..n-1, keeps every depth)")
        return None

    def bucket_of(self, query_positions, key_positions, layer):
        relative = tensor_of(query_positions)[:, None] - tensor_of(key_positions)[None, :]  # x = i - j (eq. 5)
        return lfhc_buckets(relative, self.k, layer + 1, self.rounding)

    def row_bounds(self, low, high, layer):
        """Eq. 9's rows are monotone in x = i - j: those of the smallest and largest x."""
        def row(x):
            l = layer + 1
            part = x // l if self.rounding == "floor" or x >= 0 else -((-x) // l)
            return max(-self.k, min(self.k, part)) + self.k
        return row(-high), row(-low)

    def _layer_key(self, layer):
        return layer

    def row_options(self) -> tuple:
        return (self.k, self.rounding)
