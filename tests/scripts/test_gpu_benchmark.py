"""scripts/gpu_benchmark.py on the CPU with a tiny model: the records' format, the reference figures,
FLOATER's two models, the table, and what a bad architecture name or a spent budget gives."""
import json
import os
import subprocess
import sys

import pytest
import torch

from util import REPO, load_script, run, sigterm_handler_of

SCRIPT = REPO / "scripts" / "gpu_benchmark.py"
TINY = ["--device", "cpu", "--layers", "1", "--dim", "16", "--heads", "2", "--vocab", "40", "--warmup", "1",
        "--steps", "1", "--min-seconds", "0", "--gen-length", "3", "--gen-repeats", "1"]
# the second size is past --gen-max-length: its generation is skipped by the rule, not by an error
SIZES = [(2, 12), (1, 20)]
ARCHS = ["transformer_sinusoidal", "transformer_floater"]
FLOATER_OPTIONS = ["--floater-recompute-every 10", "--floater-recompute-every 1"]
REQUIRED = {"arch": str, "options": str, "device_name": str, "torch": str, "commit": str, "dtype": str,
            "batch": int, "length": int, "train_tokens_per_s": (float, type(None)),
            "peak_memory_mb": type(None), "generate_tokens_per_s": (float, type(None)), "reference": dict}
FIGURES = ("train_tokens_per_s", "peak_memory_mb", "generate_tokens_per_s")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_benchmark")
    out = folder / "gpu_benchmark.json"
    printed = run([sys.executable, SCRIPT, *TINY, "--archs", *ARCHS, "--sizes", *(f"{b}x{n}" for b, n in SIZES),
                   "--gen-max-length", "16", "--out", out])
    return json.loads(out.read_text()), out, printed


def test_one_well_formed_record_per_measurement(measured):
    records, out, _ = measured
    assert isinstance(records, list)
    models = [("transformer", ""), ("transformer_sinusoidal", "")] + [("transformer_floater", o) for o in FLOATER_OPTIONS]
    expected = [(arch, options, dtype, b, n) for arch, options in models for dtype in ("bf16", "fp16") for b, n in SIZES]
    assert [(r["arch"], r["options"], r["dtype"], r["batch"], r["length"]) for r in records] == expected
    for item in records:
        for field, kind in REQUIRED.items():
            assert isinstance(item[field], kind), (field, item)
        assert sorted(item["reference"]) == sorted(FIGURES)
        assert item["error"] is None or isinstance(item["error"], str)
        if item["error"] is None:  # measured: positive speed, the profiler's operators named
            assert item["train_tokens_per_s"] > 0 and item["kernels"] and all(isinstance(k, str) for k in item["kernels"])
            # where the step went: operators with their self time per step, the longest first
            top = item["top_ops"]
            assert 0 < len(top) <= 15 and all(isinstance(name, str) and ms >= 0 for name, ms in top)
            assert [ms for _, ms in top] == sorted((ms for _, ms in top), reverse=True)
            assert any(name == "aten::addmm" or name == "aten::mm" for name, _ in top)  # the projections
            # all operators' time per step, at least the listed ones', beside a timed step's duration
            assert item["op_ms_per_step"] >= sum(ms for _, ms in top) - 1e-2 and item["step_ms"] > 0
            assert (item["generate_tokens_per_s"] is None) == (item["length"] > 16)
        else:  # fp16 training may fail on a CPU: then nothing else is claimed
            assert item["dtype"] == "fp16" and item["train_tokens_per_s"] is None
    assert all(item["error"] is None for item in records if item["dtype"] == "bf16")
    # whole windows of FLOATER's cached solve are timed
    assert {item.get("train_steps") for item in records if item["options"] == FLOATER_OPTIONS[0] and not item["error"]} == {10}
    assert [path.name for path in out.parent.iterdir()] == [out.name]  # no temporary file left


def test_reference_is_stock_transformer_in_the_same_cell(measured):
    records, _, _ = measured
    stock = {(r["dtype"], r["batch"], r["length"]): r for r in records if r["arch"] == "transformer"}
    assert len(stock) == 4
    for item in records:
        cell = stock[(item["dtype"], item["batch"], item["length"])]
        assert item["reference"] == {figure: cell[figure] for figure in FIGURES}


def test_table_gives_ratios_to_stock_and_floater_to_sinusoidal(measured):
    records, out, printed = measured
    table = subprocess.run([sys.executable, SCRIPT, "--table", out], capture_output=True, text=True, check=True).stdout
    assert table in printed  # the run prints the same table
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| transformer")]
    assert len(rows) == len(records)
    for row, item in zip(rows, records):
        assert row[0] == f"| {item['arch']}" and row[2:4] == [item["dtype"], f"{item['batch']} x {item['length']}"]
        if item["arch"] == "transformer" and item["error"] is None:
            assert row[5] == "1.00"  # training, as a ratio to itself
        if item["arch"] == "transformer_floater":
            sinusoidal = next(r for r in records if r["arch"] == "transformer_sinusoidal"
                              and (r["dtype"], r["batch"], r["length"]) == (item["dtype"], item["batch"], item["length"]))
            if item["error"] is None and sinusoidal["error"] is None:  # step time: the inverse of tokens/s
                assert row[10] == f"{sinusoidal['train_tokens_per_s'] / item['train_tokens_per_s']:.2f}"
        else:
            assert row[10] == ""


def test_bad_arch_is_refused_and_nothing_written(tmp_path):
    out = tmp_path / "never.json"
    done = subprocess.run([sys.executable, SCRIPT, *TINY, "--archs", "transformer_nosuch", "--out", out],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and "unknown architecture(s) transformer_nosuch" in done.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_spent_budget_records_errors_not_figures():
    """... and each model's records are saved as it is done (a run killed midway keeps them), labelled with
    the run and named with the device that a record of a model that never ran cannot ask."""
    gpu_benchmark = load_script(SCRIPT)
    saved = []
    records = gpu_benchmark.run_all(gpu_benchmark.parse_args([*TINY, "--archs", "transformer_alibi", "--budget", "1e-9"]),
                                    "run #1", "the device", save=saved.append)
    assert [(r["arch"], r["dtype"]) for r in records] == [(arch, dtype) for arch in ("transformer", "transformer_alibi")
                                                         for dtype in ("bf16", "fp16") for _ in range(2)]
    for item in records:
        assert item["error"].startswith("not measured: --budget")
        assert all(item[figure] is None and item["reference"][figure] is None for figure in FIGURES)
        assert item["run"] == "run #1" and item["device_name"] == "the device"
    assert [len(part) for part in saved] == [4, 8] and saved[0] == records[:4] and saved[1] == records


def fake_records(run, sinusoidal_speed, floater_speed):
    """One run's records of stock, sinusoidal and FLOATER in one cell, as the script writes them."""
    figures = lambda speed: {"train_tokens_per_s": speed, "peak_memory_mb": 1000.0, "generate_tokens_per_s": None}  # noqa: E731
    cell = {"device_name": "a GPU", "torch": "2.x", "commit": "abc", "dtype": "bf16", "batch": 16, "length": 512}
    return [{"arch": arch, "options": options, **cell, **figures(speed), "reference": figures(100.0), "error": None,
             "run": run}
            for arch, options, speed in (("transformer", "", 100.0), ("transformer_sinusoidal", "", sinusoidal_speed),
                                         ("transformer_floater", "--floater-recompute-every 1", floater_speed))]


def floater_step_ratios(table):
    return [line.split(" | ")[10] for line in table.splitlines() if line.startswith("| transformer_floater")]


def test_runs_are_added_to_the_file_and_compared_within_each(tmp_path):
    """A run's records join the earlier runs' in --out (before, a run replaced the whole file of recorded
    runs), under its label; --add brings a GPU machine's file in; the table compares FLOATER with the
    sinusoidal of its own run, never another's; a label the file holds is refused, the file unchanged."""
    out, device_file = tmp_path / "records.json", tmp_path / "from_the_device.json"
    out.write_text(json.dumps(fake_records("earlier", 100.0, 50.0)))
    device_file.write_text(json.dumps(fake_records(None, 200.0, 100.0)))
    script = lambda *words: subprocess.run([sys.executable, SCRIPT, *map(str, words)],  # noqa: E731
                                           capture_output=True, text=True)
    done = script("--add", device_file, "--out", out)
    assert done.returncode == 2 and "without a run label: give one with --run" in done.stderr
    done = script("--add", device_file, "--out", out, "--run", "later")
    assert done.returncode == 0, done.stderr
    records = json.loads(out.read_text())
    assert [item["run"] for item in records] == ["earlier"] * 3 + ["later"] * 3
    assert records[:3] == fake_records("earlier", 100.0, 50.0)
    table = script("--table", out).stdout
    assert table.count("Run earlier: a GPU") == 1 and table.count("Run later: a GPU") == 1
    assert floater_step_ratios(table) == ["2.00", "2.00"]  # each against its own run's sinusoidal
    before = out.read_text()
    for words in (["--add", device_file, "--run", "earlier"], ["--add", out], ["--run", "later", *TINY]):
        done = script(*words, "--out", out)
        assert done.returncode == 2 and out.read_text() == before, (words, done.stderr)
    assert "already holds the run later" in done.stderr
    out.write_text("[not json")
    done = script(*TINY, "--out", out)
    assert done.returncode == 2 and "not a file of records" in done.stderr and out.read_text() == "[not json"


def test_floater_brings_sinusoidal_and_its_solve_in_graphs_comes_first():
    """FLOATER's goals are ratios to sinusoidal's step in the same run: asked for alone, sinusoidal is
    measured too; with --floater-graphs the graphs' models (issue 36's rows) come before the default solve's."""
    gpu_benchmark = load_script(SCRIPT)
    models = gpu_benchmark.models_to_measure(gpu_benchmark.parse_args(
        ["--archs", "transformer_floater", "--floater-graphs", "--floater-recompute", "10", "1"]))
    assert models == [("transformer", ""), ("transformer_sinusoidal", ""),
                      ("transformer_floater", "POSENC_FLOATER_CUDA_GRAPHS=1 --floater-recompute-every 10"),
                      ("transformer_floater", "POSENC_FLOATER_CUDA_GRAPHS=1 --floater-recompute-every 1"),
                      ("transformer_floater", "--floater-recompute-every 10"),
                      ("transformer_floater", "--floater-recompute-every 1")]


def test_a_failed_cell_gives_nulls_and_an_error_and_the_others_go_on(tmp_path, monkeypatch):
    gpu_benchmark = load_script(SCRIPT)
    measure_cell = gpu_benchmark.measure_cell

    def out_of_memory_in_bf16(model, task, args, device, cell, steps, deadline):
        if cell[0] == "bf16":
            raise RuntimeError("out of memory (as CUDA says it)")
        return measure_cell(model, task, args, device, cell, steps, deadline)

    monkeypatch.setattr(gpu_benchmark, "measure_cell", out_of_memory_in_bf16)
    args = gpu_benchmark.parse_args([*TINY, "--sizes", "1x8", "--gen-max-length", "0"])
    gpu_benchmark.measure_model("transformer_alibi", "", args, gpu_benchmark.time.time() + 60, tmp_path / "cells.jsonl")
    failed, measured = map(json.loads, (tmp_path / "cells.jsonl").read_text().splitlines())
    assert failed["dtype"] == "bf16" and failed["error"] == "RuntimeError: out of memory (as CUDA says it)"
    assert all(failed[figure] is None for figure in FIGURES)
    assert measured["dtype"] == "fp16" and (measured["error"] is None) == (measured["train_tokens_per_s"] is not None)


def test_every_cell_starts_from_the_weights_as_built(tmp_path, monkeypatch):
    """A cell's training steps move the weights; the next cell must not start from them (FLOATER's
    dynamics trained at one length can overflow at a longer one): each cell sees the built weights."""
    gpu_benchmark = load_script(SCRIPT)
    measure_cell = gpu_benchmark.measure_cell
    before, after = [], []

    def weights(model):
        return {name: tensor.clone() for name, tensor in model.state_dict().items()}

    def remember_weights(model, *args):
        before.append(weights(model))
        measured = measure_cell(model, *args)
        after.append(weights(model))
        return measured

    monkeypatch.setattr(gpu_benchmark, "measure_cell", remember_weights)
    args = gpu_benchmark.parse_args([*TINY, "--dtypes", "bf16", "--sizes", "1x8", "1x10", "--gen-max-length", "0"])
    gpu_benchmark.measure_model("transformer_floater", "--floater-recompute-every 2", args,
                                gpu_benchmark.time.time() + 60, tmp_path / "cells.jsonl")
    records = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [r["error"] for r in records] == [None, None] and [r["train_steps"] for r in records] == [2, 2]
    assert len(before) == 2 and before[0].keys() == before[1].keys()
    # the first cell's Adam steps moved the weights, FLOATER's dynamics among them ...
    dynamics = "positional_encoding.dynamics.fc2.weight"
    assert not torch.equal(after[0][dynamics], before[0][dynamics])
    # ... and the second cell started from the built weights all the same
    assert all(torch.equal(before[0][name], before[1][name]) for name in before[0])


def test_timed_steps_cover_the_minimum_time_in_whole_windows():
    gpu_benchmark = load_script(SCRIPT)
    args = gpu_benchmark.parse_args([*TINY, "--steps", "3", "--min-seconds", "1"])
    assert gpu_benchmark.timed_steps(args, 1, 0.05) == 20  # 1 s of 50 ms steps
    assert gpu_benchmark.timed_steps(args, 1, 2.0) == 3  # --steps at least
    assert gpu_benchmark.timed_steps(args, 10, 0.05) == 20  # whole windows of K = 10
    assert gpu_benchmark.timed_steps(args, 10, 0.3) == 10


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x"])
def test_a_bad_minimum_time_is_refused(value):
    gpu_benchmark = load_script(SCRIPT)
    with pytest.raises(SystemExit):
        gpu_benchmark.parse_args([*TINY, "--min-seconds", value])
    assert gpu_benchmark.parse_args([*TINY, "--min-seconds", "0"]).min_seconds == 0.0


def test_triton_rows_follow_the_encodings_the_kernel_serves():
    """--triton: each encoding with relative terms (what kernels/triton_attention.py serves, read from
    the encodings themselves) gets a second model right after it with POSENC_TRITON_ATTENTION the other
    way from its default: off for those whose terms depend on the query (the default, auto, takes the
    kernel on CUDA for them: vectors or a value term), on for the bias-only ones."""
    from posenc_fairseq.encodings import ENCODINGS, ModelDims
    from util import perturbed_encoding

    gpu_benchmark = load_script(SCRIPT)
    served, query_dependent = [], []
    for name in sorted(ENCODINGS):
        encoding = perturbed_encoding(name, dims=ModelDims(16, 4, 2, 2))
        encoding.begin("encoder")
        term = encoding.distance_term("encoder", 0, -3, 3, 4, torch.float64)
        values = encoding.value_term("encoder", 0, -3, 3, 4, torch.float64)
        if term is not None or values is not None:
            served.append(f"transformer_{name}")
        if values is not None or (term is not None and term.vectors is not None):
            query_dependent.append(f"transformer_{name}")
    assert sorted(gpu_benchmark.TRITON_SERVES) == served
    assert sorted(gpu_benchmark.TRITON_BY_DEFAULT) == query_dependent
    models = gpu_benchmark.models_to_measure(gpu_benchmark.parse_args(
        ["--archs", "transformer_shaw", "transformer_alibi", "--triton"]))
    assert models == [("transformer", ""), ("transformer_alibi", ""), ("transformer_alibi", "POSENC_TRITON_ATTENTION=on"),
                      ("transformer_shaw", ""), ("transformer_shaw", "POSENC_TRITON_ATTENTION=off")]


def test_an_out_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    """Before, --out under a file was found when the first model's records were saved (its GPU time spent)
    and ended in FileExistsError's traceback; --add ended the same way."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "run.json").write_text(json.dumps(fake_records("r1", 100.0, 50.0)))
    out = tmp_path / "afile" / "records.json"
    for words in ([*TINY, "--archs", "transformer_sinusoidal", "--sizes", "1x8"], ["--add", tmp_path / "run.json"]):
        done = subprocess.run([sys.executable, SCRIPT, *map(str, words), "--out", str(out)], capture_output=True,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"gpu_benchmark: cannot write {out}: {tmp_path / 'afile'} is not a folder this user may write in"], done.stderr


def test_an_interrupt_ends_the_models_process_too(tmp_path):
    """Ctrl-C reaches every process of the terminal's group, SIGTERM only this one: before, the model's
    process went on measuring (and the interpreter waited for it at exit)."""
    gpu_benchmark = load_script(SCRIPT)
    killed = []

    class Child:
        def start(self):
            pass

        def join(self, timeout=None):
            if timeout is not None:  # waiting for the model: the interrupt arrives
                raise KeyboardInterrupt

        def kill(self):
            killed.append(True)

    context = type("Context", (), {"Process": lambda self, target, args: Child()})()
    with pytest.raises(KeyboardInterrupt):
        gpu_benchmark.measure_in_process(context, "transformer", "", gpu_benchmark.parse_args(TINY), 60,
                                         tmp_path / "cells.jsonl")
    assert killed == [True]


def test_sigterm_ends_a_run_as_ctrl_c_does():
    """Before, SIGTERM (kill, a job scheduler's stop) ended the run at once, past the removal of its
    temporary files that an interrupt runs."""
    assert sigterm_handler_of(SCRIPT) == "posenc_fairseq.cli_signals"
