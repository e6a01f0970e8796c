"""examples/claims/sweep.py: the Process-50 robustness grid. Its cells and options against hand-written
ones, its per-cell rates against hand-counted records, and a toy sweep through fairseq's commands whose
every run reached fairseq with its cell's settings and is not run again when the sweep is repeated."""
import json
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from test_claims import counted
from util import BIN, REPO, load_script, run

SWEEP = REPO / "examples" / "claims" / "sweep.py"
sweep_module = load_script(SWEEP)
# runner.py's cell with lr 5e-4, polynomial decay, batch 32 (the traced run's)
CELL_5E4 = sweep_module.cell_folder(sweep_module.Cell(lr=5e-4, betas="0.9,0.98", schedule="polynomial_decay", batch=32,
                                                      clip=1.0, ffn=256, dropout=0.1, data_seed=1))


@pytest.fixture(scope="module")
def sweep():
    return sweep_module


def test_run_folders_are_named_by_the_cells_settings(sweep):
    """Two sweeps in one folder with other axes: the first cell of each is another cell, in another
    folder (by its index in each grid both were cell0, and trained into one save-dir)."""
    lower_lr = sweep.parse(["--out", "x", "--lr", "5e-4"]).axes
    smaller_batch = sweep.parse(["--out", "x", "--batch", "32"]).axes
    first, second = sweep.cells(lower_lr)[0], sweep.cells(smaller_batch)[0]
    assert first != second and sweep.cell_folder(first) != sweep.cell_folder(second)
    assert sweep.cell_folder(first) == sweep.cell_folder(sweep.Cell(**first._asdict()))
    assert "/" not in sweep.cell_folder(first) and "," not in sweep.cell_folder(first)


def test_the_grid_is_every_combination_and_shards_split_it(sweep):
    args = sweep.parse(["--out", "x", "--lr", "1e-3", "2e-4", "--batch", "32", "64", "--dropout", "0"])
    grid = sweep.cells(args.axes)
    assert len(grid) == 4 and {(cell.lr, cell.batch) for cell in grid} == {(1e-3, 32), (1e-3, 64), (2e-4, 32), (2e-4, 64)}
    # the axes not given keep runner.py's settings; a given 0 stays 0
    assert {(c.betas, c.schedule, c.clip, c.ffn, c.dropout, c.data_seed) for c in grid} == {
        ("0.9,0.98", "inverse_sqrt", 1.0, 256, 0.0, 1)}
    parts = [sweep.shard(grid, f"{i}/3") for i in range(3)]
    assert sorted(sum(parts, []), key=grid.index) == grid and all(parts)
    assert len(sweep.cells(sweep.parse(["--out", "x", "--issue-grid"]).axes)) == 3 * 2 ** 6  # lr x six axes of two values, one data draw
    with pytest.raises(SystemExit):
        sweep.shard(grid, "3/3")
    with pytest.raises(SystemExit):
        sweep.parse(["--out", "x", "--betas", "0.9"])


def test_a_cells_options_as_fairseq_reads_them(sweep):
    args = sweep.parse(["--out", "x", "--train", "100", "--epochs", "3"])
    cell = sweep.Cell(5e-4, "0.9,0.999", "polynomial_decay", 32, 0.0, 128, 0.0, 1)
    options = sweep.fairseq_options(cell, args)
    pairs = dict(zip(options[::2], options[1::2]))
    assert sweep.work_folder("roberta_at5:--at5-gamma-range 64 256", 3) == "roberta_at5_--at5-gamma-range_64_256_seed3"
    assert pairs == {"--adam-betas": "(0.9,0.999)", "--clip-norm": "0", "--encoder-ffn-embed-dim": "128",
                     "--dropout": "0", "--attention-dropout": "0", "--lr-scheduler": "polynomial_decay",
                     "--warmup-updates": "100", "--total-num-update": "12", "--end-learning-rate": "0"}  # 3 x ceil(100/32)


def record(arch, test, lr=1e-3, seed=1):
    cell = dict(lr=lr, betas="0.9,0.98", schedule="inverse_sqrt", batch=64, clip=1.0, ffn=256, dropout=0.1, data_seed=1)
    return {"arch": arch, "cell": cell, "seed": seed, "test": test, "device": "cpu", "epochs": 40,
            "sizes": [5000, 1000, 5000]}


def test_rates_and_the_cells_that_decide(sweep):
    records = [record("roberta_at5", 0.55, seed=1), record("roberta_at5", 0.83, seed=2), record("roberta_at5", 0.80, seed=3),
               record("roberta_t5", 0.81, seed=1), record("roberta_t5", 0.76, seed=2), record("roberta_t5", 0.74, seed=3),
               record("roberta_at5", 0.82, lr=2e-4), record("roberta_t5", 0.56, lr=2e-4)]
    table = sweep.summary(records)
    at_1e3 = table[(1e-3, "0.9,0.98", "inverse_sqrt", 64, 1.0, 256, 0.1, 1)]
    assert at_1e3["roberta_at5"] == {"runs": 3, "failed": 0, "rate": pytest.approx(2 / 3),
                                     "mean": pytest.approx(0.726666, abs=1e-5)}
    assert at_1e3["roberta_t5"] == {"runs": 3, "failed": 0, "rate": pytest.approx(2 / 3), "mean": pytest.approx(0.77)}
    assert sweep.decides(at_1e3)  # the same rate, but AT5's mean 0.727 < T5's 0.770 - 0.01
    assert not sweep.decides(table[(2e-4, "0.9,0.98", "inverse_sqrt", 64, 1.0, 256, 0.1, 1)])
    text = sweep.markdown(records, ["roberta_at5", "roberta_t5"])
    assert "| 0.001 | 0.9,0.98 | inverse_sqrt | 64 | 1 | 256 | 0.1 | 1 | 2/3 (0.727) | 2/3 (0.770) | yes |" in text
    assert "| 0.0002 | 0.9,0.98 | inverse_sqrt | 64 | 1 | 256 | 0.1 | 1 | 1/1 (0.820) | 0/1 (0.560) |  |" in text


def test_failed_runs_are_counted_apart_until_they_finish(sweep, tmp_path):
    """A run that failed (test null) is not a plateau outcome: the table counts it apart from k/n; once a
    retry finishes, only the finished record counts."""
    kept = tmp_path / "kept.jsonl"
    lines = [record("roberta_at5", 0.83, seed=1), record("roberta_at5", None, seed=2), record("roberta_at5", None, seed=3),
             record("roberta_at5", 0.55, seed=3), record("roberta_t5", None, seed=1), record("roberta_t5", None, seed=1)]
    kept.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert len(sweep.recorded(kept)) == 2  # what a resumed sweep will not run again: seed 2 and T5 are retried
    runs = list(sweep.recorded(kept, failed=True).values())
    assert sorted((r["arch"], r["seed"], r["test"]) for r in runs) == [
        ("roberta_at5", 1, 0.83), ("roberta_at5", 2, None), ("roberta_at5", 3, 0.55), ("roberta_t5", 1, None)]
    by_arch = sweep.summary(runs)[(1e-3, "0.9,0.98", "inverse_sqrt", 64, 1.0, 256, 0.1, 1)]
    assert by_arch["roberta_at5"] == {"runs": 2, "failed": 1, "rate": 0.5, "mean": pytest.approx(0.69)}
    assert by_arch["roberta_t5"] == {"runs": 0, "failed": 1, "rate": None, "mean": None}
    assert not sweep.decides(by_arch)  # T5 has no finished run to compare with
    text = sweep.markdown(runs, ["roberta_at5", "roberta_t5"])
    assert "| 0.001 | 0.9,0.98 | inverse_sqrt | 64 | 1 | 256 | 0.1 | 1 | 1/2 (0.690), 1 failed | 1 failed |  |" in text
    sweep.plot(runs, ["roberta_at5", "roberta_t5"], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.slow
def test_a_toy_sweep_runs_every_cell_through_fairseq_and_resumes(tmp_path, sweep):
    keep = tmp_path / "kept.jsonl"
    command = [sys.executable, SWEEP, "--out", tmp_path / "sweep", "--keep", keep, "--encodings", "roberta_t5",
               "roberta_nope", "--lr", "1e-3", "5e-4", "--schedule", "polynomial_decay", "--batch", "32",
               "--seeds", "1", "--train", "96", "--valid", "32", "--test", "32", "--epochs", "2", "--jobs", "2"]
    out = run(command, env={"PATH": str(BIN)})
    records = [json.loads(line) for line in keep.read_text().splitlines()]
    assert sorted((r["arch"], r["cell"]["lr"]) for r in records) == [
        ("roberta_nope", 5e-4), ("roberta_nope", 1e-3), ("roberta_t5", 5e-4), ("roberta_t5", 1e-3)]
    for r in records:
        work = tmp_path / "sweep" / sweep_module.cell_folder(sweep_module.Cell(**r["cell"])) / f"{r['arch']}_seed1"
        log = (work / "train.log").read_text()
        # the cell's settings reached fairseq (its logged configuration), after runner.py's own
        assert re.search(rf"'lr': \[{r['cell']['lr']}\]", log) and "'batch_size': 32" in log
        assert re.search(r"'_name': 'polynomial_decay'.*'total_num_update': 6", log)  # 2 epochs x ceil(96/32)
        assert "'clip_norm': 1.0" in log and "'adam_betas': '(0.9,0.98)'" in log
        assert re.search(r"[ (]dropout=0\.1,", log) and re.search(r"[ (]attention_dropout=0\.1,", log)
        assert "encoder_ffn_embed_dim=256," in log
        right, examples = counted((work / "test.log").read_text(), "test")
        assert examples == 32 and r["test"] == right / examples  # the run's count of right answers
    table = (tmp_path / "sweep" / "results.md").read_text()
    assert table in out and table.count("/1 (") == 4  # 2 cells x 2 encodings, one run each
    again = run(command, env={"PATH": str(BIN)})  # every run recorded: nothing trains again
    assert "4 recorded, 0 to run" in again and len(keep.read_text().splitlines()) == 4
    assert (tmp_path / "sweep" / "results.md").read_text() == table


@pytest.mark.slow
def test_the_traced_run_is_the_sweeps_run(tmp_path):
    """at5_dynamics.py trains one cell through fairseq's Trainer in its own process: the validation
    losses it records are the ones fairseq-train logged for the same cell, seed and ARCH:OPTIONS entry
    in a sweep (to the log's 3 decimals), and every update's record has T5's table, the attention and the rest."""
    settings = ["--lr", "5e-4", "--schedule", "polynomial_decay", "--batch", "32", "--train", "96", "--valid", "32",
                "--test", "32", "--epochs", "2"]
    entry = "roberta_t5:--t5-num-buckets 8"  # (a table of 8 buckets instead of 32: the options reach fairseq)
    run([sys.executable, SWEEP, "--out", tmp_path / "sweep", "--encodings", entry, "--seeds", "2", *settings],
        env={"PATH": str(BIN)})
    work = tmp_path / "sweep" / CELL_5E4 / sweep_module.work_folder(entry, 2)
    logged = [float(loss) for loss in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)",
                                                 (work / "train.log").read_text())]
    assert "t5_num_buckets=8," in (work / "train.log").read_text()
    out = run([sys.executable, REPO / "examples" / "claims" / "at5_dynamics.py", "--out", tmp_path / "trace",
               "--arch", entry, "--seed", "2", "--every", "1", *settings], env={"PATH": str(BIN)})
    trace = tmp_path / "trace" / f"{sweep_module.work_folder(entry, 2)}.jsonl"
    assert not trace.with_name(trace.name + ".partial").exists()  # (the trace while the run lasts)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    traced = [r["valid_loss"] for r in records if "valid_loss" in r and r["epoch"] > 0]
    assert len(logged) == len(traced) == 2
    for fairseq_loss, ours in zip(logged, traced):
        assert f"{ours:.3f}" == f"{fairseq_loss:.3f}"
    steps = [r for r in records if "groups" in r]
    assert [r["update"] for r in steps] == list(range(1, 7))  # 2 epochs x 3 batches
    assert set(steps[0]["groups"]) == {"table", "attention", "other"}
    # the first update runs at lr 0 (fairseq sets the warm-up's lr for update 0 before it); the others move the table
    assert steps[0]["groups"]["table"]["update"] == 0 and all(r["groups"]["table"]["update"] > 0 for r in steps[1:])
    assert len(records[-1]["bias"]) == 4 and len(records[-1]["bias"][0]) == 7  # heads x d = -3..3
    assert "| table |" in out


@pytest.mark.parametrize("option", [["--jobs", "2"], ["--cuda"], ["--seeds", "1", "2"], ["--keep", "x.jsonl"]])
def test_the_trace_refuses_the_sweeps_options_it_would_ignore(tmp_path, option):
    """at5_dynamics.py traces one run on the CPU: the sweep's options for many runs are not its own."""
    done = subprocess.run([sys.executable, REPO / "examples" / "claims" / "at5_dynamics.py", "--out", tmp_path,
                           *option], capture_output=True, text=True)
    assert done.returncode == 2 and f"unrecognized arguments: {' '.join(option)}" in done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["--jobs", "--threads"])
def test_the_sweep_refuses_fewer_than_one_job(sweep, capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse(["--out", "x", option, "0"])
    assert exit_info.value.code == 2 and f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err


def test_each_run_records_the_trees_commit_unless_told(sweep):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert sweep.parse(["--out", "x"]).commit in (head, head + "-dirty")
    assert sweep.parse(["--out", "x", "--commit", "abc1234"]).commit == "abc1234"


def test_the_data_is_binarised_once_and_never_left_half_written(sweep, tmp_path, monkeypatch):
    """Two sweeps sharing a folder binarise its data once (a lock); a binarisation that fails leaves
    no `bin` behind, so the next sweep redoes it instead of reading a half-written folder."""
    calls = []

    def slow_preprocess(raw, data, fields, log, env):
        calls.append(data)
        time.sleep(0.3)  # long enough for the other thread to arrive while this one holds the lock
        for field in fields:
            (data / field).mkdir(parents=True)
            (data / field / "dict.txt").write_text("x 1\n")
        return data

    monkeypatch.setattr(sweep, "preprocess", slow_preprocess)
    args = SimpleNamespace(train=5, valid=2, test=2)
    found = []
    threads = [threading.Thread(target=lambda: found.append(sweep.data_for(tmp_path, 1, args, {}))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and found == [tmp_path / "data_seed1_5-2-2" / "bin"] * 2
    assert (tmp_path / "data_seed1_5-2-2" / "bin" / "label" / "dict.txt").exists()

    def interrupted(raw, data, fields, log, env):
        (data / fields[0]).mkdir(parents=True)
        (data / fields[0] / "dict.txt").write_text("x 1\n")
        raise RuntimeError("fairseq-preprocess failed")

    monkeypatch.setattr(sweep, "preprocess", interrupted)
    with pytest.raises(RuntimeError):
        sweep.data_for(tmp_path, 2, args, {})
    assert sorted(path.name for path in (tmp_path / "data_seed2_5-2-2").iterdir()) == [".lock", "raw"]
    monkeypatch.setattr(sweep, "preprocess", slow_preprocess)
    assert (sweep.data_for(tmp_path, 2, args, {}) / "input0" / "dict.txt").exists()


def test_other_sizes_get_their_own_data(sweep, tmp_path, monkeypatch):
    """A second sweep in the same folder with other --train/--valid/--test draws and binarises its own
    data (its records say these sizes), rather than reading the first one's."""
    monkeypatch.setattr(sweep, "preprocess", lambda raw, data, fields, log, env: data.mkdir(exist_ok=True))
    small = sweep.data_for(tmp_path, 1, SimpleNamespace(train=20, valid=10, test=10), {})
    large = sweep.data_for(tmp_path, 1, SimpleNamespace(train=60, valid=30, test=30), {})
    assert small != large
    for data, count in ((small, 20), (large, 60)):
        lines = (data.parent / "raw" / "train.input0").read_text().splitlines()
        assert len(lines) == count
