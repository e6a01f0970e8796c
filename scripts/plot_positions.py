#!/usr/bin/env python
"""Draw what the positional encoding of a checkpoint of this package learned.

    python scripts/plot_positions.py CHECKPOINT [--out DIR] [--data DATA-BIN] [--length N]

Loads CHECKPOINT through fairseq (any `transformer_*`, `roberta_*`, `transformer_lm_*` architecture of this package;
`--data` when the data folder the checkpoint was trained on has moved: fairseq needs its
dictionaries) and writes, for each picture, a PNG and the numbers behind it as CSV into DIR
(default: CHECKPOINT's folder/positions/). Distances are always `key_minus_query` = j - i.

- logit-bias encodings (t5, t5_nob, at5, at5_nob, alibi), per stack (encoder, decoder) and layer
  that has a bias:
  `bias_ROLE_layerL.csv`  the bias e_h(j - i) added to the logits, per head, against j - i;
  `prior_ROLE_layerL.csv` the prior beta of AT5 paper eq. 6 (softmax over the keys 0..N-1 of the
  bias, causal in the decoder) per head for a few query positions (AT5 paper figure 4).
- shaw, lfhc: `relative_ROLE_layerL_key.csv` (and `_value` with a value table): cosine similarity
  of the learned relative embeddings of every pair of distances; `relative_ROLE_key.png` shows
  the layers side by side (LFHC's coarsening shows as blocks that grow with the layer).
- xl, gcdf: `prior_R.csv` the fixed prior R (rows: distances, columns: dimensions of d_model) and
  `projected_norm_ROLE_layerL.csv` the norm of the learned W_r R per head against distance.
- floater: `floater_ROLE_layerL_{q,k,v}.csv` the bias b(t_i) - b(0) (rows: positions 0..N-1,
  columns: dimensions; FLOATER paper figure 3, as far as --length, also beyond the training
  lengths) and `floater_norms.csv` its norm per slot and its largest entry against position
  (printed: where it leaves float16's range, if it does).
- every model with an absolute input embedding (sinusoidal or learned; FLOATER paper figure 3a/3b):
  `input_positions_ROLE.csv` (rows: positions 0..N-1, columns: dimensions).

Prints the files it wrote with one line on what each shows. DIR/plot_positions.files names them: a
later run into DIR first removes those files (and no others), so it refuses a CHECKPOINT in DIR that is
named there or like an output (.csv, .png).
"""
import argparse
import csv
import math
import os
import pickle
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import check_checkpoint, check_output, replaced_whole, write_text_atomic  # noqa: E402

from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402

import torch  # noqa: E402

QUERY_FRACTIONS = (0.0, 0.25, 0.5, 1.0)  # query positions of the prior plots, as fractions of N - 1


# --- loading -------------------------------------------------------------------------------------
def load_model(checkpoint: Path, data: Path = None):
    """The model of `checkpoint` in eval mode on CPU, loaded the way fairseq loads it."""
    import posenc_fairseq  # noqa: F401  (registers the models, allows the checkpoint's globals)
    from fairseq import checkpoint_utils

    overrides = {"data": str(data)} if data is not None else None
    try:
        models, cfg, _ = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides=overrides)
    except FileNotFoundError as error:
        raise SystemExit(f"error: {error}\n(fairseq needs the dictionaries of the data the model was trained on: "
                         "give their folder with --data)")
    except pickle.UnpicklingError as error:  # (torch's message advises weights_only=False: not the point here)
        detail = next((line.strip() for line in str(error).splitlines() if "Unsupported" in line), "")
        raise SystemExit(f"error: torch.load cannot read {checkpoint}: not a fairseq checkpoint"
                         + (f" ({detail[:200]})" if detail else ""))
    except RuntimeError as error:
        if "PytorchStreamReader" not in str(error):
            raise
        raise SystemExit(f"error: torch.load cannot read {checkpoint}: {str(error).splitlines()[0]} "
                         "(a truncated or damaged file?)")
    model = models[0].float().eval()
    if getattr(model, "positional_encoding", None) is None:
        raise SystemExit(f"error: {checkpoint} is not a model of this package (no positional_encoding); "
                         "only transformer_*/roberta_* architectures of posenc_fairseq have one")
    return model


def stacks(model):
    """{'encoder': stack, 'decoder': stack} of a translation model, RoBERTa ('encoder') or a
    language model ('decoder')."""
    found = {}
    encoder = getattr(model, "encoder", None)
    if encoder is not None:
        found["encoder"] = getattr(encoder, "sentence_encoder", encoder)  # RoBERTa: its sentence encoder
    if getattr(model, "decoder", None) is not None:
        found["decoder"] = model.decoder
    return found


# --- output ----------------------------------------------------------------------------------------
#: the files the last run wrote into its output folder, one name per line
MANIFEST = "plot_positions.files"


class Writer:
    """Writes the tables and figures into `out`; first removes those an earlier run wrote there (its
    MANIFEST: another checkpoint's files would read as this one's), never anything else.

    Each file goes through a temporary file beside it and os.replace: a link of that name is replaced,
    not followed (it may point at the checkpoint), and a run that stops midway leaves no half-written
    file. MANIFEST names each file before the file is put in place, so that the next run can always
    remove what this one left."""

    def __init__(self, out: Path, dpi: int):
        self.out, self.dpi, self.written = out, dpi, []
        self.prefix = ""  # 'encoder_part_' / 'decoder_part_' for models with one encoding part per stack
        self._guard(out, lambda: out.mkdir(parents=True, exist_ok=True))
        earlier = earlier_files(out)
        for name in earlier:  # (MANIFEST keeps naming them until all are gone)
            if (out / name).is_file() or (out / name).is_symlink():
                self._guard(out / name, (out / name).unlink, "remove")
        if earlier:
            self._list([])

    def finish(self):
        self._list(path.name for path, _ in self.written)

    def _list(self, names):
        manifest = self.out / MANIFEST
        self._guard(manifest, lambda: write_text_atomic(manifest, "".join(f"{name}\n" for name in names)))

    def _put(self, name: str, what: str, write):
        """`write(temporary path)`, then the file in place as `name` in `out`, listed in MANIFEST first."""
        path = self.out / (self.prefix + name)
        self._list([*(done.name for done, _ in self.written), path.name])

        def replace():
            with replaced_whole(path) as temporary:
                write(temporary)
        self._guard(path, replace)
        self.written.append((path, what))
        return path

    @staticmethod
    def _guard(path, action, doing="write"):
        """`action()`; an OSError (disk full, a folder that takes no files) ends the run in one line."""
        try:
            action()
        except OSError as error:
            raise SystemExit(f"error: cannot {doing} {path}: {error.strerror or error}") from None

    def csv(self, name: str, header, rows, what: str):
        def write(temporary):
            with open(temporary, "w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(header)
                for row in rows:
                    writer.writerow([_number(value) for value in row])
        return self._put(name, what, write)

    def figure(self, figure, name: str, what: str):
        import matplotlib.pyplot as plt

        try:  # (the temporary file ends in .png: matplotlib takes the format from it)
            return self._put(name, what, lambda temporary: figure.savefig(temporary, dpi=self.dpi, bbox_inches="tight"))
        finally:
            plt.close(figure)


def earlier_files(out: Path) -> list:
    """The files an earlier run's MANIFEST in `out` lists (plain names only: never a path elsewhere)."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return []
    return [name for name in manifest.read_text().splitlines() if name and "/" not in name and name not in (".", "..")]


def check_checkpoint_apart(checkpoint: Path, out: Path, fail):
    """`fail(message)` where this run would replace or remove the checkpoint: it writes CSV and PNG files
    and MANIFEST into `out`, after removing the files an earlier run's MANIFEST lists there."""
    checkpoint = checkpoint.resolve()
    if checkpoint.parent != out.resolve():
        return
    if checkpoint.suffix in (".csv", ".png") or checkpoint.name in (MANIFEST, *earlier_files(out)):
        fail(f"{checkpoint} is in --out {out} under a name this run would replace or remove: give another --out")


def _number(value):
    if isinstance(value, float):
        return f"{value:.9g}"
    return value


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def matplotlib_colors():
    import matplotlib.colors

    return matplotlib.colors


def matrix_rows(first_column, matrix):
    return [[int(label)] + [float(v) for v in row] for label, row in zip(first_column, matrix.tolist())]


# --- logit bias: T5, T5-NoB, AT5, AT5-NoB, ALiBi ------------------------------------------------------
def bias_row(encoding, role, layer, query: int, keys: torch.Tensor):
    """(heads, len(keys)) logit bias of the query at position `query`, or None (no bias there: no
    term, or one that depends on the tokens)."""
    from posenc_fairseq.encodings.distance import bias_between

    # the hook memoizes per forward: compute afresh, leave the model's pass alone
    with torch.no_grad(), encoding.cache.apart():
        bias = bias_between(encoding, role, layer, torch.tensor([query]), keys, torch.float32)
    return None if bias is None else bias[:, 0].float()


def key_distances(role: str, max_distance: int):
    """The distances j - i that a query's keys are at, -D..D; in a decoder -D..0 (causal: the future
    mask blocks the keys after the query, whatever the encoding has for them)."""
    return torch.arange(-max_distance, (max_distance if role == "encoder" else 0) + 1)


def plot_logit_bias(model, encoding, writer, length, max_distance):
    from posenc_fairseq.encodings.prior import prior_distribution

    plt = _plt()
    heads = encoding.dims.heads
    made = False
    for role in stacks(model):
        for layer in range(encoding.dims.layers(role)):
            # bias against distance: query at max_distance, keys from 0 (decoder: up to the query)
            distances = key_distances(role, max_distance)
            bias = bias_row(encoding, role, layer, max_distance, distances + max_distance)
            if bias is None:
                continue
            made = True
            tag = f"{role}_layer{layer}"
            writer.csv(f"bias_{tag}.csv", ["key_minus_query"] + [f"head{h}" for h in range(heads)],
                       matrix_rows(distances, bias.t()), f"{role} layer {layer}: logit bias per head against j - i")
            figure, axis = plt.subplots(figsize=(5, 3))
            for head in range(heads):
                axis.plot(distances.tolist(), bias[head].tolist(), label=f"head {head}", lw=1, **curve_style(head))
            axis.set(xlabel="key - query (j - i)", ylabel="logit bias",
                     title=f"{encoding.name}: {role} layer {layer}")
            axis.legend(fontsize=6, ncol=2)
            writer.figure(figure, f"bias_{tag}.png", f"{role} layer {layer}: logit bias per head")

            # prior beta (eq. 6) over keys 0..length-1 for a few query positions, per head
            keys = torch.arange(length)
            queries = sorted({round(f * (length - 1)) for f in QUERY_FRACTIONS})
            rows = []
            priors = {}
            for query in queries:
                prior = torch.stack([prior_distribution(encoding, role, layer, query, keys, head).cpu()
                                     for head in range(heads)])  # (heads, keys)
                priors[query] = prior
                rows += [[query, key] + prior[:, key].tolist() for key in range(length)]
            writer.csv(f"prior_{tag}.csv", ["query", "key"] + [f"head{h}" for h in range(heads)], rows,
                       f"{role} layer {layer}: prior beta (softmax of the bias over keys) per head and query")
            columns = min(heads, 4)
            grid = math.ceil(heads / columns)
            figure, axes = plt.subplots(grid, columns, figsize=(2.3 * columns, 2.1 * grid), squeeze=False,
                                        sharex=True, layout="constrained")
            for head in range(heads):
                axis = axes[head // columns][head % columns]
                for query in queries:
                    axis.plot(keys.tolist(), priors[query][head].tolist(), lw=1, label=f"i={query}")
                axis.set_title(f"head {head}", fontsize=8)
                axis.tick_params(labelsize=6)
            for extra in range(heads, grid * columns):
                axes[extra // columns][extra % columns].axis("off")
            axes[0][0].legend(fontsize=5)
            figure.suptitle(f"{encoding.name}: prior over keys j, {role} layer {layer}", fontsize=9)
            figure.supxlabel("key position j", fontsize=8)
            figure.supylabel("prior beta of key j for query i", fontsize=8)
            writer.figure(figure, f"prior_{tag}.png", f"{role} layer {layer}: prior beta per head")
    return made


# --- Shaw / LFHC ---------------------------------------------------------------------------------------
def relative_embeddings(encoding, table, role, layer, max_distance):
    """(distances j - i of `role`'s keys, the embedding each distance uses at `layer`)."""
    distances = key_distances(role, max_distance)
    rows = encoding.bucket_of(torch.tensor([max_distance]), distances + max_distance, layer)[0]
    return distances, table.detach().float()[rows]


def cosine_matrix(vectors):
    unit = vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.t()


def plot_relative_embeddings(model, encoding, writer, max_distance):
    plt = _plt()
    for role in stacks(model):
        for kind, tables in (("key", encoding.key_tables), ("value", encoding.value_tables)):
            layers = [layer for layer in range(encoding.dims.layers(role)) if f"{role}{layer}" in tables]
            if not layers:
                continue
            # one figure per role and kind, a panel per layer (LFHC's coarsening side by side)
            figure, axes = plt.subplots(1, len(layers), figsize=(3.1 * len(layers) + 0.6, 3), squeeze=False,
                                        layout="constrained")
            for panel, layer in enumerate(layers):
                distances, vectors = relative_embeddings(encoding, tables[f"{role}{layer}"], role, layer, max_distance)
                similarity = cosine_matrix(vectors)
                tag = f"{role}_layer{layer}_{kind}"
                writer.csv(f"relative_{tag}.csv", ["key_minus_query"] + [str(int(d)) for d in distances],
                           matrix_rows(distances, similarity),
                           f"{role} layer {layer}: cosine similarity of the {kind} embeddings of distances j - i")
                axis = axes[0][panel]
                extent = [int(distances[0]) - 0.5, int(distances[-1]) + 0.5] * 2
                image = axis.imshow(similarity.numpy(), cmap="RdBu_r", vmin=-1, vmax=1, extent=extent, origin="lower")
                axis.set_title(f"layer {layer}", fontsize=8)
                axis.set_xlabel("j - i", fontsize=7)
                axis.tick_params(labelsize=6)
            axes[0][0].set_ylabel("j - i", fontsize=7)
            figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
            figure.suptitle(f"{encoding.name}: cosine similarity of the {kind} embeddings of distances, {role}",
                            fontsize=8)
            writer.figure(figure, f"relative_{role}_{kind}.png",
                          f"{role}: {kind} embedding similarity of every pair of distances, a panel per layer")


# --- XL / GCDF -----------------------------------------------------------------------------------------
def plot_projected_prior(model, encoding, writer, max_distance):
    plt = _plt()
    distances = torch.arange(-max_distance, max_distance + 1)  # key - query
    with torch.no_grad():
        prior = encoding.prior(-distances).float()  # R_{i-j}, (N, d_model)
    d_model = prior.size(1)
    writer.csv("prior_R.csv", ["key_minus_query"] + [f"dim{k}" for k in range(d_model)], matrix_rows(distances, prior),
               "the fixed prior R_{i-j} (rows: distances j - i, columns: dimensions)")
    figure, axis = plt.subplots(figsize=(5, 3))
    image = axis.imshow(prior.t().numpy(), aspect="auto", cmap="viridis", origin="lower",
                        extent=[int(distances[0]) - 0.5, int(distances[-1]) + 0.5, -0.5, d_model - 0.5])
    figure.colorbar(image, ax=axis)
    axis.set(xlabel="key - query (j - i)", ylabel="dimension", title=f"{encoding.name}: prior R")
    writer.figure(figure, "prior_R.png", "the fixed prior R against distance")
    heads, head_dim = encoding.dims.heads, encoding.dims.head_dim
    norms = {}
    for role in stacks(model):
        seen = key_distances(role, max_distance)
        for layer in range(encoding.dims.layers(role)):
            projection = encoding.projections[f"{role}{layer}"]
            with torch.no_grad():
                projected = projection(prior[: len(seen)].to(projection.weight.dtype)).float()
            norm = projected.view(len(seen), heads, head_dim).norm(dim=-1)  # (N, heads)
            norms[(role, layer)] = seen, norm
            writer.csv(f"projected_norm_{role}_layer{layer}.csv",
                       ["key_minus_query"] + [f"head{h}" for h in range(heads)], matrix_rows(seen, norm),
                       f"{role} layer {layer}: |W_r R_(i-j)| per head against j - i")
    figure, axis = plt.subplots(figsize=(5, 3))
    for index, ((role, layer), (seen, norm)) in enumerate(norms.items()):
        axis.plot(seen.tolist(), norm.mean(dim=1).tolist(), lw=1, label=f"{role} layer {layer}", **curve_style(index))
    axis.set(xlabel="key - query (j - i)", ylabel="mean over heads of |W_r R|", title=f"{encoding.name}: learned W_r R")
    axis.legend(fontsize=6)
    writer.figure(figure, "projected_norm.png", "norm of the learned W_r R against distance, per layer")


# --- FLOATER -------------------------------------------------------------------------------------------
def floater_slots(encoding):
    """[(role, layer, which)] in table order: encoder, decoder, cross; layer; q, k, v."""
    index = getattr(encoding, "_slot_index", None) or {}
    return [slot for slot, _ in sorted(index.items(), key=lambda item: item[1])]


def curve_style(index: int) -> dict:
    """Colour and line style of the `index`-th curve of a figure: 20 colours, then other line styles
    (matplotlib's default cycle repeats after 10, so an 18-slot legend named two curves alike)."""
    import matplotlib

    return {"color": matplotlib.colormaps["tab20"](index % 20), "ls": ("-", "--", ":")[index // 20 % 3]}


def plot_floater(model, encoding, writer, length, layers, mark=None):
    plt = _plt()
    with torch.no_grad():
        table = encoding.table(length)[:length].float().cpu()  # (positions, slots, d): b(t_i) - b(0)
    name = f"FLOATER{' ' + writer.prefix.replace('_', ' ').strip() if writer.prefix else ''}"
    finite = torch.isfinite(table).flatten(1).all(dim=1)
    if not bool(finite.all()):  # (drawn up to there: beyond, float32's inf and NaN would fill the pictures)
        length = int((~finite).nonzero()[0, 0])
        if length < 2:
            raise SystemExit(f"error: {name}: the solve leaves float32's range at once: nothing to draw")
        print(f"{name}: the solve leaves float32's range at position {length}: drawn up to position {length - 1}")
        table, mark = table[:length], mark if mark is not None and mark < length else None
    slots = floater_slots(encoding)
    positions = torch.arange(length)
    norm = table.double().norm(dim=-1)  # (positions, slots); in float64: squares of finite float32 entries may not be
    peak = table.abs().flatten(1).amax(dim=1)  # largest |entry| per position, against fp16's range
    names = [f"{role}{layer}{which}" for role, layer, which in slots]
    writer.csv("floater_norms.csv", ["position"] + names + ["max_abs"],
               [row + [float(p)] for row, p in zip(matrix_rows(positions, norm), peak)],
               "|b(t_i) - b(0)| per slot and the largest entry against position")
    fp16 = torch.finfo(torch.float16).max
    beyond = (peak > fp16).nonzero()
    print(f"{name}: largest |b(t_i) - b(0)| entry {float(peak.max()):.4g} (position {int(peak.argmax())}); "
          + (f"beyond float16's range ({fp16:.0f}) from position {int(beyond[0, 0])}" if len(beyond)
             else f"within float16's range ({fp16:.0f}) up to position {length - 1}"))
    figure, axis = plt.subplots(figsize=(5, 3))
    for column, name in enumerate(names):
        axis.plot(positions.tolist(), norm[:, column].tolist(), lw=1, label=name, **curve_style(column))
    if mark:
        axis.axvline(mark, color="grey", ls="--", lw=0.8)
    axis.set(xlabel="position i", ylabel="|b(t_i) - b(0)|", title="FLOATER: norm of the position bias")
    axis.set_yscale("symlog", linthresh=1.0)  # (growth beyond the training lengths is exponential: straight lines)
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=5, ncol=3)
    writer.figure(figure, "floater_norms.png", "norm of b(t_i) - b(0) against position, per slot")
    for role, layer, which in slots:
        if layer not in layers:
            continue
        column = slots.index((role, layer, which))
        values = table[:, column]  # (positions, d)
        tag = f"{role}_layer{layer}_{which}"
        writer.csv(f"floater_{tag}.csv", ["position"] + [f"dim{k}" for k in range(values.size(1))],
                   matrix_rows(positions, values), f"{role} layer {layer} {which}: b(t_i) - b(0), positions x dimensions")
    for role in dict.fromkeys(role for role, _, _ in slots):
        chosen = [(layer, which) for r, layer, which in slots if r == role and layer in layers]
        if not chosen:
            continue
        columns = 3
        grid = math.ceil(len(chosen) / columns)
        figure, axes = plt.subplots(grid, columns, figsize=(3 * columns, 2.4 * grid), squeeze=False,
                                    layout="constrained")
        shown = table[:, [slots.index((role, l, w)) for l, w in chosen]].abs()
        scale = float(shown.max()) or 1.0
        # symmetric log colours: the biases grow fast with the position, so a linear scale would
        # show only the longest positions; linear within 1/4 of the first quarter's peak
        early = float(shown[: max(2, length // 4)].max())
        colours = matplotlib_colors().SymLogNorm(linthresh=max(early / 4, scale * 1e-4, 1e-12), vmin=-scale, vmax=scale)
        for number, (layer, which) in enumerate(chosen):
            axis = axes[number // columns][number % columns]
            values = table[:, slots.index((role, layer, which))]
            image = axis.imshow(values.t().numpy(), aspect="auto", cmap="RdBu_r", norm=colours,
                                origin="lower", extent=[-0.5, length - 0.5, -0.5, values.size(1) - 0.5])
            if mark:
                axis.axvline(mark, color="black", ls="--", lw=0.6)
            axis.set_title(f"layer {layer} {which}", fontsize=8)
            axis.tick_params(labelsize=6)
        for extra in range(len(chosen), grid * columns):
            axes[extra // columns][extra % columns].axis("off")
        figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
        figure.suptitle(f"FLOATER {role}: b(t_i) - b(0), position (x) by dimension (y), symmetric log colours"
                        + ("; dashed: --mark-length" if mark else ""), fontsize=8)
        writer.figure(figure, f"floater_{role}.png", f"{role}: heat maps of b(t_i) - b(0), positions x dimensions")


# --- absolute input embedding --------------------------------------------------------------------------------
def input_positions(stack, length):
    """(positions 0..n-1, (n, d) embedding added at each position) of a stack, or None."""
    from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

    module = getattr(stack, "embed_positions", None)
    if module is None:
        return None
    offset = module.padding_idx + 1  # fairseq's positions start after the padding index
    if isinstance(module, SinusoidalPositionalEmbedding):
        table = SinusoidalPositionalEmbedding.get_embedding(length + offset, module.embedding_dim, module.padding_idx)
        return "sinusoidal", table[offset:].float()
    if isinstance(module, LearnedPositionalEmbedding):
        rows = min(length, module.num_embeddings - offset)
        return "learned", module.weight.detach()[offset: offset + rows].float()
    return None


def plot_input_positions(model, writer, length):
    plt = _plt()
    made = False
    for role, stack in stacks(model).items():
        found = input_positions(stack, length)
        if found is None:
            continue
        kind, table = found
        made = True
        positions = torch.arange(table.size(0))
        whole = f" (the whole table: {table.size(0)} positions, fewer than --length {length})" \
            if table.size(0) < length else ""
        writer.csv(f"input_positions_{role}.csv", ["position"] + [f"dim{k}" for k in range(table.size(1))],
                   matrix_rows(positions, table),
                   f"{role}: {kind} absolute input embedding, positions x dimensions{whole}")
        figure, axis = plt.subplots(figsize=(5, 3))
        image = axis.imshow(table.t().numpy(), aspect="auto", cmap="RdBu_r", origin="lower",
                            extent=[-0.5, table.size(0) - 0.5, -0.5, table.size(1) - 0.5])
        figure.colorbar(image, ax=axis)
        axis.set(xlabel="position", ylabel="dimension", title=f"{kind} input embedding ({role})")
        writer.figure(figure, f"input_positions_{role}.png", f"{role}: {kind} input embedding heat map")
    return made


# --- main ----------------------------------------------------------------------------------------------------
def plot_checkpoint(checkpoint, out, data=None, length=128, max_distance=None, layers=None, dpi=100, mark=None):
    """Everything the command does; returns [(path, what)] of the files written."""
    from posenc_fairseq.encodings.alibi import ALiBi
    from posenc_fairseq.encodings.floater import Floater
    from posenc_fairseq.encodings.shaw import Shaw
    from posenc_fairseq.encodings.t5 import ScalarBias
    from posenc_fairseq.encodings.xl import TransformerXL

    model = load_model(Path(checkpoint), data)
    # unequal encoder/decoder sizes: one encoding part per stack (PerStackEncoding), each drawn alone
    whole = model.positional_encoding
    parts = [("", whole)] if not hasattr(whole, "parts") else [
        (f"{role}_part_", part) for role, part in zip(("encoder", "decoder"), whole.parts())]
    deepest = max(max(part.dims.encoder_layers, part.dims.decoder_layers) for _, part in parts)
    floater_options = [option for option, value in (("--layers", layers), ("--mark-length", mark)) if value is not None]
    if floater_options and not all(isinstance(encoding, Floater) for _, encoding in parts):  # (it would be ignored)
        raise SystemExit(f"error: {' and '.join(floater_options)}: FLOATER's option(s), and {checkpoint} is a "
                         f"{whole.name} model")
    missing = sorted(set(layers or []) - set(range(deepest)))
    if missing:  # (before anything is written)
        raise SystemExit(f"error: --layers {','.join(map(str, missing))}: {checkpoint} has layers 0-{deepest - 1}")
    writer = Writer(Path(out), dpi)
    for prefix, encoding in parts:
        writer.prefix = prefix
        all_layers = range(max(encoding.dims.encoder_layers, encoding.dims.decoder_layers))
        chosen = set(all_layers if layers is None else layers)
        if isinstance(encoding, (ScalarBias, ALiBi)):
            plot_logit_bias(model, encoding, writer, length, given_or(max_distance, 128))
        elif isinstance(encoding, Shaw):
            deepest = max(encoding.dims.encoder_layers, encoding.dims.decoder_layers)
            plot_relative_embeddings(model, encoding, writer, given_or(max_distance, encoding.k * (deepest + 1)))
        elif isinstance(encoding, TransformerXL):
            plot_projected_prior(model, encoding, writer, given_or(max_distance, length))
        elif isinstance(encoding, Floater):
            plot_floater(model, encoding, writer, length, chosen, mark)
        else:
            # sinusoidal / learned / nope / rotary, or an encoding added later: try the generic logit bias
            plot_logit_bias(model, encoding, writer, length, given_or(max_distance, 128))
    writer.prefix = ""
    plot_input_positions(model, writer, length)
    writer.finish()
    return whole.name, writer.written


def given_or(value, default):
    """`value` where the user gave it (None: not given), else `default`."""
    return default if value is None else value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, help="output folder (default: CHECKPOINT's folder/positions)")
    parser.add_argument("--data", type=Path, help="data folder with the dictionaries (default: the checkpoint's)")
    parser.add_argument("--length", type=int, default=128,
                        help="positions N: keys of the prior plots, rows of the FLOATER and input-embedding "
                             "tables (default %(default)s)")
    parser.add_argument("--max-distance", type=int,
                        help="largest |j - i| of the distance plots (default: 128 for logit biases, "
                             "k * (layers + 1) for shaw/lfhc, N for xl/gcdf)")
    parser.add_argument("--layers", type=lambda text: [int(x) for x in text.split(",")],
                        help="FLOATER: comma-separated layers of the heat maps (default: all)")
    parser.add_argument("--mark-length", type=int, metavar="L",
                        help="FLOATER: draw a dashed line at position L (e.g. the longest training input)")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    check_checkpoint(args.checkpoint, parser.error)
    if args.length < 2:
        parser.error("--length must be at least 2")
    if args.max_distance is not None and args.max_distance < 1:
        parser.error(f"--max-distance {args.max_distance}: must be at least 1")
    if args.dpi < 1:
        parser.error(f"--dpi {args.dpi}: must be at least 1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    out = args.out or args.checkpoint.parent / "positions"
    check_output(out / MANIFEST, [args.checkpoint], parser.error)  # (out a file, or not writable: one line)
    check_checkpoint_apart(args.checkpoint, out, parser.error)
    name, written = plot_checkpoint(args.checkpoint, out, args.data, args.length, args.max_distance,
                                    args.layers, args.dpi, args.mark_length)
    if not written:
        print(f"{name}: nothing learned or position-dependent to draw (no bias, table or input embedding)")
    for path, what in written:
        print(f"{path}: {what}")


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    main()
