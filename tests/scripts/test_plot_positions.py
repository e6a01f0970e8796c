"""scripts/plot_positions.py on tiny checkpoints trained by fairseq-train: the command writes a PNG
and a CSV per picture, and every CSV holds what the formulas give from the checkpoint's own
parameters (read from its state dict, independently of the script)."""
import csv
import math
import os
import subprocess
import sys

import pytest
import torch

from util import REPO, sigterm_handler_of

SCRIPT = REPO / "scripts" / "plot_positions.py"
LENGTH = 40


def plot(checkpoint, out, *options):
    done = subprocess.run([sys.executable, str(SCRIPT), str(checkpoint), "--out", str(out), "--length", str(LENGTH),
                           *map(str, options)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg"))
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    for line in done.stdout.splitlines():  # every announced file exists
        if line.startswith(str(out)):
            assert (out / line.split(":")[0].rsplit("/", 1)[-1]).exists(), line
    return done.stdout


def read(path):
    """(header, first column, tensor of the other columns) of a CSV the command wrote."""
    with open(path) as handle:
        rows = list(csv.reader(handle))
    values = torch.tensor([[float(v) for v in row] for row in rows[1:]], dtype=torch.float64)
    return rows[0], values[:, 0].long(), values[:, 1:]


def model_state(checkpoint):
    import posenc_fairseq  # noqa: F401  (safe globals)

    return torch.load(checkpoint, map_location="cpu")["model"]


def check_priors(out, role, layer, heads):
    """Each prior row sums to 1, is softmax over the keys of the bias CSV's values at j - i (with
    keys after the query excluded in the decoder)."""
    _, distances, bias = read(out / f"bias_{role}_layer{layer}.csv")
    assert distances.min() <= -(LENGTH - 1)  # the bias CSV covers every distance of the prior
    at = {int(d): row for d, row in zip(distances, bias)}
    header, queries, values = read(out / f"prior_{role}_layer{layer}.csv")
    keys, prior = values[:, 0].long(), values[:, 1:]
    assert header[2:] == [f"head{h}" for h in range(heads)]
    for query in sorted(set(queries.tolist())):
        rows = queries == query
        row_keys, row_prior = keys[rows], prior[rows]
        assert row_keys.tolist() == list(range(LENGTH))
        torch.testing.assert_close(row_prior.sum(0), torch.ones(heads, dtype=torch.float64), atol=1e-6, rtol=0)
        zero = torch.zeros(heads, dtype=torch.float64)  # decoder: keys after the query (masked below)
        scores = torch.stack([at.get(int(key) - query, zero) for key in row_keys])  # (keys, heads)
        if role == "decoder":
            scores[row_keys > query] = -math.inf
        torch.testing.assert_close(row_prior, torch.softmax(scores, dim=0), atol=1e-6, rtol=1e-5)


def test_t5_bias_and_prior_match_the_table(tiny_checkpoint, tmp_path):
    from posenc_fairseq.encodings.t5 import relative_position_bucket

    checkpoint = tiny_checkpoint("transformer_t5")
    listing = plot(checkpoint, tmp_path)
    assert "prior beta" in listing
    state = model_state(checkpoint)
    for role, bidirectional in (("encoder", True), ("decoder", False)):
        table = state[f"positional_encoding.tables.{role}"].double()  # (32 buckets, 4 heads)
        header, distances, bias = read(tmp_path / f"bias_{role}_layer0.csv")
        assert header[0] == "key_minus_query"
        assert distances.tolist() == list(range(-128, 129 if bidirectional else 1))
        expected = table[relative_position_bucket(distances, bidirectional, 32, 128)]
        torch.testing.assert_close(bias, expected, atol=1e-6, rtol=1e-6)
        check_priors(tmp_path, role, 0, heads=4)
        assert (tmp_path / f"bias_{role}_layer0.png").stat().st_size > 1000
        assert (tmp_path / f"prior_{role}_layer0.png").exists()
    assert not (tmp_path / "bias_encoder_layer1.csv").exists()  # --scalar-bias-layers first


@pytest.mark.parametrize("option, value", [("--max-distance", 0), ("--max-distance", -5), ("--dpi", 0)])
def test_bad_values_end_in_a_usage_error(tiny_checkpoint, tmp_path, option, value):
    """Before, --max-distance 0 became the default (128) and -5 a traceback inside torch."""
    done = subprocess.run([sys.executable, str(SCRIPT), str(tiny_checkpoint("transformer_alibi")), "--out",
                           str(tmp_path), option, str(value)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and f"error: {option} {value}: must be at least 1" in done.stderr
    assert "Traceback" not in done.stderr and not any(tmp_path.iterdir())


def test_alibi_bias_is_minus_slope_times_distance(tiny_checkpoint, tmp_path):
    plot(tiny_checkpoint("transformer_alibi"), tmp_path, "--max-distance", 50)
    slopes = torch.tensor([2 ** (-8 * h / 4) for h in range(1, 5)], dtype=torch.float64)
    for role in ("encoder", "decoder"):
        for layer in (0, 1):
            _, distances, bias = read(tmp_path / f"bias_{role}_layer{layer}.csv")
            assert distances.min() == -50
            torch.testing.assert_close(bias, -distances.abs()[:, None].double() * slopes[None, :], atol=1e-6, rtol=1e-6)
            check_priors(tmp_path, role, layer, heads=4)


def test_language_model_alibi_decoder_bias(masked_lm_data, tmp_path):
    from util import QUICK_TRAIN, USER_DIR, run

    save = tmp_path / "lm"
    run(["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
         "transformer_lm_alibi", "--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
         "--decoder-attention-heads", "4", "--tokens-per-sample", "32", *QUICK_TRAIN, "--max-update", "1",
         "--save-dir", save])
    plot(save / "checkpoint_last.pt", tmp_path / "out", "--max-distance", LENGTH)
    _, distances, bias = read(tmp_path / "out" / "bias_decoder_layer0.csv")  # decoder only: no encoder
    assert distances.tolist() == list(range(-LENGTH, 1))
    slopes = torch.tensor([2 ** (-8 * h / 4) for h in range(1, 5)], dtype=torch.float64)
    torch.testing.assert_close(bias, -distances.abs()[:, None].double() * slopes[None, :], atol=1e-6, rtol=1e-6)
    check_priors(tmp_path / "out", "decoder", 0, heads=4)
    assert not list((tmp_path / "out").glob("*encoder*"))


def test_lfhc_similarity_of_relative_embeddings_and_learned_input_embedding(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("transformer_lfhc", "--lfhc-k", 3, "--input-positions", "learned")
    plot(checkpoint, tmp_path)
    state = model_state(checkpoint)
    for role in ("encoder", "decoder"):
        for layer in (0, 1):
            table = state[f"positional_encoding.key_tables.{role}{layer}"].double()  # (2k+1, d_head)
            header, distances, similarity = read(tmp_path / f"relative_{role}_layer{layer}_key.csv")
            # k * (layers + 1) each side; the decoder's keys stop at the query (its future mask blocks the rest)
            last = 9 if role == "encoder" else 0
            assert distances.tolist() == list(range(-9, last + 1))
            assert header[1:] == [str(d) for d in range(-9, last + 1)]
            # eq. 9 of Qu et al. on x = i - j = -(j - i), floor rounding, layer l = layer + 1
            rows = torch.div(-distances, layer + 1, rounding_mode="floor").clamp(-3, 3) + 3
            vectors = table[rows]
            expected = torch.nn.functional.cosine_similarity(vectors[:, None, :], vectors[None, :, :], dim=-1)
            torch.testing.assert_close(similarity, expected, atol=1e-6, rtol=1e-5)
        assert not (tmp_path / f"relative_{role}_layer0_value.csv").exists()  # key term only by default
    # layer 2 groups distances in pairs: j - i = 0 and -1 (x = 0, 1) share an embedding
    _, distances, similarity = read(tmp_path / "relative_encoder_layer1_key.csv")
    zero, minus_one = int((distances == 0).nonzero()), int((distances == -1).nonzero())
    assert similarity[zero, minus_one] == pytest.approx(1.0, abs=1e-6)
    # the learned absolute input embedding: fairseq's table after the padding rows
    for role in ("encoder", "decoder"):
        _, positions, values = read(tmp_path / f"input_positions_{role}.csv")
        weight = state[f"{role}.embed_positions.weight"].double()
        torch.testing.assert_close(values, weight[2: 2 + len(positions)], atol=1e-6, rtol=1e-5)
    # a --length beyond the table draws the whole table, and says so
    rows = state["encoder.embed_positions.weight"].size(0) - 2
    listing = plot(checkpoint, tmp_path / "long", "--length", rows + 10)
    assert f"input embedding, positions x dimensions (the whole table: {rows} positions, fewer than --length " \
           f"{rows + 10})" in listing


def test_gcdf_prior_and_projected_norm(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("transformer_gcdf")
    plot(checkpoint, tmp_path, "--max-distance", 20)
    state = model_state(checkpoint)
    _, distances, prior = read(tmp_path / "prior_R.csv")
    d_model = 32
    k = torch.arange(d_model, dtype=torch.float64)
    x = (-distances.double())[:, None] / d_model ** (k / d_model)[None, :]  # R is of i - j
    expected = 4.0 * 0.5 * (1 + torch.erf(x / math.sqrt(2)))  # eqs. 14-15, lambda = 4
    torch.testing.assert_close(prior, expected, atol=1e-6, rtol=1e-5)
    for role in ("encoder", "decoder"):
        for layer in (0, 1):
            weight = state[f"positional_encoding.projections.{role}{layer}.weight"].double()
            _, seen, norm = read(tmp_path / f"projected_norm_{role}_layer{layer}.csv")
            assert seen.tolist() == list(range(-20, 21 if role == "encoder" else 1))  # decoder: keys up to the query
            projected = (expected[: len(seen)] @ weight.t()).view(len(seen), 4, 8)
            torch.testing.assert_close(norm, projected.norm(dim=-1), atol=1e-5, rtol=1e-4)


def floater_reference(state, b0, times):
    """b(t) - b(0) by torchdiffeq's rk4 in float64 with step delta / 5 (the defaults) from the
    checkpoint's dynamics weights: h(tau, b) = W2 [relu(W1 [b; tau] + c1); tau] + c2."""
    import torchdiffeq

    w1, c1, w2, c2 = (state[f"positional_encoding.dynamics.{name}"].double()
                      for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))

    def h(t, b):
        tau = t.expand(b.size(0), 1)
        hidden = torch.relu(torch.cat([b, tau], dim=-1) @ w1.t() + c1)
        return torch.cat([hidden, tau], dim=-1) @ w2.t() + c2

    return torchdiffeq.odeint(h, b0, times, method="rk4", options=dict(step_size=0.02)) - b0


def test_floater_matrix_solves_the_ode_of_the_checkpoint(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("transformer_floater", "--floater-init", "small")
    listing = plot(checkpoint, tmp_path, "--layers", "0", "--mark-length", 20)
    assert "within float16's range" in listing
    state = model_state(checkpoint)
    times = torch.arange(LENGTH, dtype=torch.float64) * 0.1  # t_i = i * delta
    for role, attention in (("encoder", "encoder.layers.0.self_attn"), ("decoder", "decoder.layers.0.self_attn"),
                            ("cross", "decoder.layers.0.encoder_attn")):
        b0 = torch.stack([state[f"{attention}.{which}_proj.bias"].double() for which in "qkv"])  # b(0): the biases
        expected = floater_reference(state, b0, times)  # (positions, 3, d)
        assert expected[1:].abs().max() > 1e-6  # the small init moved h away from zero
        for index, which in enumerate("qkv"):
            header, positions, values = read(tmp_path / f"floater_{role}_layer0_{which}.csv")
            assert positions.tolist() == list(range(LENGTH)) and header[1:] == [f"dim{k}" for k in range(32)]
            torch.testing.assert_close(values, expected[:, index], atol=1e-6, rtol=1e-4)
        assert (tmp_path / f"floater_{role}.png").exists()
    assert not (tmp_path / "floater_encoder_layer1_q.csv").exists()  # --layers 0
    header, _, norms = read(tmp_path / "floater_norms.csv")
    # 2 + 2 layers of self-attention and 2 of cross-attention, q/k/v each, in the table's order
    assert header[1:4] == ["encoder0q", "encoder0k", "encoder0v"] and header[7:10] == ["decoder0q", "decoder0k", "decoder0v"]
    assert header[13] == "cross0q" and header[-1] == "max_abs" and norms.shape == (LENGTH, 19)
    _, _, q = read(tmp_path / "floater_encoder_layer0_q.csv")
    torch.testing.assert_close(norms[:, 0], q.norm(dim=-1), atol=1e-5, rtol=1e-4)
    assert norms[0].abs().max() == 0  # b(t_0) - b(0) = 0
    # FLOATER keeps the base architecture's sinusoidal input embedding: fairseq's formula
    _, positions, values = read(tmp_path / "input_positions_encoder.csv")
    half = 16
    frequencies = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angles = (positions.double() + 2)[:, None] * frequencies[None, :]  # fairseq counts from padding_idx + 1 = 2
    torch.testing.assert_close(values, torch.cat([angles.sin(), angles.cos()], dim=1), atol=1e-5, rtol=1e-4)
    assert "input embedding" in listing


def test_floater_biases_beyond_float32s_range_are_drawn_up_to_where_they_leave_it(tiny_checkpoint, tmp_path):
    """h(b, t) = relu(30 b + 1): b grows as exp(30 t). Before, norms of finite biases past 1.8e19 were
    written as inf (their squares overflow float32), and a table that leaves float32's range printed a
    NaN as its largest entry, filled the CSVs with NaN and inf, or ended in matplotlib's traceback."""
    import posenc_fairseq  # noqa: F401  (safe globals)

    saved = torch.load(tiny_checkpoint("transformer_floater", "--floater-init", "small"), map_location="cpu")
    state = saved["model"]
    fc1, fc2 = state["positional_encoding.dynamics.fc1.weight"], state["positional_encoding.dynamics.fc2.weight"]
    (hidden, width), dim = fc1.shape, fc2.size(0)
    fc1.copy_(torch.cat([30 * torch.eye(hidden, dim), torch.zeros(hidden, width - dim)], dim=1))
    fc2.copy_(torch.cat([torch.eye(dim, hidden), torch.zeros(dim, fc2.size(1) - hidden)], dim=1))
    state["positional_encoding.dynamics.fc1.bias"].fill_(1.0)
    state["positional_encoding.dynamics.fc2.bias"].zero_()
    torch.save(saved, tmp_path / "growing.pt")
    listing = plot(tmp_path / "growing.pt", tmp_path / "out", "--layers", "0")
    drawn = int(listing.split("the solve leaves float32's range at position ")[1].split(":")[0])
    assert 20 < drawn < LENGTH and "entry nan" not in listing
    _, positions, norms = read(tmp_path / "out" / "floater_norms.csv")
    assert positions.tolist() == list(range(drawn)) and bool(torch.isfinite(norms).all())
    _, _, q = read(tmp_path / "out" / "floater_encoder_layer0_q.csv")
    assert q.abs().max() > 1e20  # squares beyond float32's range, norms within
    torch.testing.assert_close(norms[:, 0], q.norm(dim=-1), atol=0, rtol=1e-6)


def test_a_layer_the_model_lacks_or_a_file_that_is_no_checkpoint_ends_in_one_line(tiny_checkpoint, tmp_path):
    """Before, --layers 7 of a 2-layer FLOATER model drew nothing and exited 0, and a file that is not a
    checkpoint ended in torch's traceback advising weights_only=False (KeyError: 105 for one starting
    with 'i')."""
    checkpoint = tiny_checkpoint("transformer_floater", "--floater-init", "small")
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    (tmp_path / "log.pt").write_text("iteration 5 loss 3.2")
    (tmp_path / "cut.pt").write_bytes(checkpoint.read_bytes()[:1000])
    for arguments, code, message in (
            ([checkpoint, "--layers", "1,7"], 1, "error: --layers 7: "),
            # FLOATER's options of another encoding's model (before: ignored without a word)
            ([tiny_checkpoint("transformer_t5"), "--layers", "0", "--mark-length", "9"], 1,
             "error: --layers and --mark-length: FLOATER's option(s), and "),
            ([tmp_path / "notes.pt"], 2, "notes.pt is not a fairseq checkpoint (not a file written by torch.save)"),
            ([tmp_path / "log.pt"], 2, "log.pt is not a fairseq checkpoint"),
            # a checkpoint cut short (a half-finished copy; before: torch's RuntimeError traceback)
            ([tmp_path / "cut.pt"], 1, "cut.pt: PytorchStreamReader failed reading zip archive")):
        out = tmp_path / "out"
        done = subprocess.run([sys.executable, str(SCRIPT), *map(str, arguments), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == code and message in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
        assert "Traceback" not in done.stderr and not out.exists()
    (tmp_path / "taken").write_text("")  # --out a file (before: FileExistsError's traceback)
    done = subprocess.run([sys.executable, str(SCRIPT), str(checkpoint), "--out", str(tmp_path / "taken")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "is not a folder this user may write in" in done.stderr, done.stderr[-2000:]


def test_a_second_checkpoint_into_the_same_folder_leaves_none_of_the_firsts_files(tiny_checkpoint, tmp_path):
    """Before, FLOATER's tables and input-embedding table stayed beside a later ALiBi model's plots in
    the same --out, as if ALiBi had them; a file the script did not write stays."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    plot(tiny_checkpoint("transformer_floater", "--floater-init", "small"), out, "--layers", "0")
    assert list(out.glob("floater_*"))
    listing = plot(tiny_checkpoint("transformer_alibi"), out)
    written = {line.split(":")[0].rsplit("/", 1)[-1] for line in listing.splitlines() if line.startswith(str(out))}
    assert {path.name for path in out.iterdir()} == written | {"notes.txt", "plot_positions.files"}


def copied_checkpoint(tiny_checkpoint, path):
    """A copy of the tiny T5 checkpoint at `path` (a test that may overwrite it leaves the shared one alone)."""
    import shutil

    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tiny_checkpoint("transformer_t5"), path)
    return path, path.read_bytes()


def test_an_output_name_that_links_to_the_checkpoint_is_replaced_not_followed(tiny_checkpoint, tmp_path):
    """Before, open(path, 'w') followed the link: the CSV overwrote the checkpoint."""
    checkpoint, before = copied_checkpoint(tiny_checkpoint, tmp_path / "ck.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "bias_encoder_layer0.csv").symlink_to(checkpoint)
    plot(checkpoint, out)
    assert checkpoint.read_bytes() == before
    assert not (out / "bias_encoder_layer0.csv").is_symlink()
    assert read(out / "bias_encoder_layer0.csv")[0][0] == "key_minus_query"
    assert oct((out / "bias_encoder_layer0.csv").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask():
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_a_checkpoint_this_run_would_replace_or_remove_is_refused_before_any_work(tiny_checkpoint, tmp_path):
    """Before, a checkpoint inside --out named like an output (or listed by an earlier run's
    plot_positions.files, which the run removes first) was overwritten or deleted."""
    out = tmp_path / "out"
    listed, before = copied_checkpoint(tiny_checkpoint, out / "model.pt")
    (out / "plot_positions.files").write_text("model.pt\n")
    named_as_output, _ = copied_checkpoint(tiny_checkpoint, out / "prior_decoder_layer0.csv")
    (tmp_path / "alias.pt").symlink_to(named_as_output)
    for checkpoint in (listed, named_as_output, tmp_path / "alias.pt"):
        done = subprocess.run([sys.executable, str(SCRIPT), str(checkpoint), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "under a name this run would replace or remove: give another --out" in done.stderr.strip().splitlines()[-1]
        assert "Traceback" not in done.stderr
    assert listed.read_bytes() == before and named_as_output.read_bytes() == before
    assert sorted(path.name for path in out.iterdir()) == ["model.pt", "plot_positions.files", "prior_decoder_layer0.csv"]


# plot_positions.main with the rows of its 3rd CSV raising after 5 rows (a full disk, Ctrl-C)
FAIL_MIDWAY = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("plot_positions", sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
real, calls = script.Writer.csv, [0]
def csv(self, name, header, rows, what):
    calls[0] += 1
    if calls[0] == 3:
        def broken(rows=rows):
            for number, row in enumerate(rows):
                if number == 5:
                    raise OSError(28, "No space left on device") if sys.argv[2] == "full" else KeyboardInterrupt
                yield row
        rows = broken()
    return real(self, name, header, rows, what)
script.Writer.csv = csv
script.main(sys.argv[3:])
"""


def test_a_run_that_stops_midway_leaves_whole_files_all_named_in_the_manifest(tiny_checkpoint, tmp_path):
    """Before, the earlier run's manifest went first and the new one came last: a run that stopped midway
    left a truncated CSV and no manifest, so the next run could not clean up; a full disk ended in a
    traceback."""
    checkpoint, _ = copied_checkpoint(tiny_checkpoint, tmp_path / "ck.pt")
    out = tmp_path / "out"
    plot(checkpoint, out)
    (out / "notes.txt").write_text("the user's")
    for failure in ("full", "interrupt"):
        done = subprocess.run([sys.executable, "-c", FAIL_MIDWAY, str(SCRIPT), failure, str(checkpoint), "--out", str(out),
                               "--length", str(LENGTH)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg"))
        assert done.returncode != 0
        if failure == "full":
            assert done.stderr.strip().splitlines()[-1] == \
                f"error: cannot write {out / 'bias_decoder_layer0.csv'}: No space left on device", done.stderr[-2000:]
            assert "Traceback" not in done.stderr
        # the manifest names every file there (no temporary file is left), the one it was writing too
        listed = set((out / "plot_positions.files").read_text().split())
        there = {path.name for path in out.iterdir()} - {"notes.txt", "plot_positions.files"}
        assert there <= listed and "bias_encoder_layer0.csv" in there, (failure, there - listed)
        assert "bias_decoder_layer0.csv" not in there  # not half written
        for name in there:
            if name.endswith(".csv"):
                assert len(read(out / name)[1]) > 5  # whole
    listing = plot(checkpoint, out)
    written = {line.split(":")[0].rsplit("/", 1)[-1] for line in listing.splitlines() if line.startswith(str(out))}
    assert {path.name for path in out.iterdir()} == written | {"notes.txt", "plot_positions.files"}


def test_sigterm_ends_a_run_as_ctrl_c_does():
    """Before, SIGTERM (kill, a job scheduler's stop) ended the run at once, past the clean-up of its
    temporary files that an interrupt runs."""
    assert sigterm_handler_of(SCRIPT) == "posenc_fairseq.cli_signals"


def test_every_curve_of_a_figure_has_its_own_style():
    """FLOATER's norms draw one curve per slot (18 for 2+2 layers); matplotlib's default cycle of 10
    colours named two of them alike in the legend."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_positions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    styles = [module.curve_style(index) for index in range(60)]
    assert len({(style["color"], style["ls"]) for style in styles}) == 60
