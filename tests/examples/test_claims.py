"""examples/claims/: the papers' small claims at toy size. Process-50 (AT5 paper, table 1): the data
follow the description (two Markov chains, P(repeat) 0.57 / 0.43, balanced classes, Bayes rate from
the exact formula matches the Bayes classifier on generated data), and the runner goes through
fairseq-preprocess, fairseq-train and a count of the best checkpoint's right answers
(examples/checkpoint_eval.py) and prints its table: one run per entry and seed, each row holding the
accuracies of its runs (read back from the logs here: counts, and the validations fairseq logged)."""
import argparse
import json
import math
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from util import BIN, REPO, load_script, run

CLAIMS = REPO / "examples" / "claims"
SCRIPT = CLAIMS / "process50.py"


def test_process50_data_follow_the_description(tmp_path):
    module = load_script(SCRIPT)
    module.write_split(tmp_path, "train", 4000, random.Random(0))
    sequences = [list(map(int, line.split())) for line in (tmp_path / "train.input0").read_text().splitlines()]
    labels = [int(line) for line in (tmp_path / "train.label").read_text().splitlines()]
    assert len(sequences) == len(labels) == 4000 and sum(labels) == 2000
    assert all(len(sequence) == 50 and set(sequence) <= {0, 1} for sequence in sequences)
    repeats = [sum(a == b for a, b in zip(sequence, sequence[1:])) for sequence in sequences]
    for label, expected in ((0, 0.57), (1, 0.43)):
        rate = sum(r for r, y in zip(repeats, labels) if y == label) / (49 * labels.count(label))
        assert abs(rate - expected) < 0.01, (label, rate)
    ones = sum(map(sum, sequences)) / (50 * 4000)
    assert abs(ones - 0.5) < 0.01  # symbol counts carry no class information
    bayes = sum((r > 24.5) == (y == 0) for r, y in zip(repeats, labels)) / 4000  # the Bayes classifier
    assert abs(module.bayes_accuracy() - 0.839) < 0.001 and abs(bayes - module.bayes_accuracy()) < 0.02


def test_process_at_a_lag_repeats_the_symbol_that_many_places_before(tmp_path):
    """--lag 6 --length 20: the class shows only in comparisons 6 apart; neighbours say nothing."""
    module = load_script(SCRIPT)
    module.write_split(tmp_path, "train", 4000, random.Random(0), (0.75, 0.25), length=20, lag=6)
    sequences = [list(map(int, line.split())) for line in (tmp_path / "train.input0").read_text().splitlines()]
    labels = [int(line) for line in (tmp_path / "train.label").read_text().splitlines()]
    assert all(len(sequence) == 20 for sequence in sequences) and sum(labels) == 2000

    def repeat_rate(label, lag):
        pairs = [(a, b) for sequence, y in zip(sequences, labels) if y == label for a, b in zip(sequence, sequence[lag:])]
        return sum(a == b for a, b in pairs) / len(pairs)
    assert abs(repeat_rate(0, 6) - 0.75) < 0.01 and abs(repeat_rate(1, 6) - 0.25) < 0.01
    for label in (0, 1):
        assert abs(repeat_rate(label, 1) - 0.5) < 0.015
    repeats = [sum(a == b for a, b in zip(sequence, sequence[6:])) for sequence in sequences]
    right = sum((r > 7) == (y == 0) for r, y in zip(repeats, labels)) + 0.5 * sum(r == 7 for r in repeats)
    assert abs(right / 4000 - module.bayes_accuracy((0.75, 0.25), length=20, lag=6)) < 0.015


def logged_accuracies(log_text, subset):
    """Every accuracy (a fraction) fairseq logged on `subset` ('valid' during training, 'test' from
    fairseq-validate), in order: read here from the log, not through the runner's parser."""
    accuracies = []
    for line in log_text.splitlines():
        if f"on '{subset}' subset |" in line:
            cells = dict(cell.strip().split(" ", 1) for cell in line.split(f"on '{subset}' subset |")[1].split(" | "))
            if "accuracy" in cells:
                accuracies.append(float(cells["accuracy"]) / 100)
    return accuracies


def counted(log_text, subset):
    """(right, examples) of `subset` as examples/checkpoint_eval.py printed them in a run's test.log
    (the runner's own pass over the best checkpoint: counts, where fairseq logs rounded accuracies)."""
    found = re.findall(rf"^{subset}: (\d+) of (\d+) correct", log_text, flags=re.M)
    assert len(found) == 1, log_text[-2000:]
    return tuple(int(x) for x in found[0])


def assert_counts_of(accuracy, sequences):
    """An accuracy really measured on `sequences` examples: a whole number of them right (fairseq's
    sentence_prediction logs the percentage rounded to one decimal)."""
    assert min(abs(100 * right / sequences - 100 * accuracy) for right in range(sequences + 1)) <= 0.05 + 1e-9, accuracy


def results_by_run(out_folder):
    """results.jsonl, the runner's record of each finished run: {(entry, seed): result}; a run recorded
    twice fails."""
    results = [json.loads(line) for line in (out_folder / "results.jsonl").read_text().splitlines() if line]
    by_run = {(result["entry"], result["seed"]): result for result in results}
    assert len(by_run) == len(results), results
    return by_run


def binomial_tail(n, p, at_least):
    """P(Binomial(n, p) >= at_least)."""
    return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(at_least, n + 1))


@pytest.mark.slow
def test_process50_runs_through_fairseq_and_prints_the_table(tmp_path):
    entries = ["roberta_t5", "roberta_at5:--at5-length-scale 50"]
    out = run([sys.executable, SCRIPT, "--out", tmp_path, "--train", "200", "--valid", "64", "--test", "64",
               "--epochs", "1", "--batch-size", "32", "--jobs", "2", "--arch", *entries], env={"PATH": str(BIN)})
    rows = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]]
            for row in out.splitlines() if row.startswith("| `")}
    assert set(rows) == {"`roberta_t5`", "`roberta_at5:--at5-length-scale 50`"}
    assert rows["`roberta_t5`"][3] == "0.808"  # the paper's number beside ours
    assert (tmp_path / "results.md").read_text() in out
    # the Bayes rate of the heading, computed here another way: the repeat counts of the two classes
    # mirror each other (0.57 = 1 - 0.43), so the Bayes classifier is right iff class 0 repeats >= 25 times
    assert f"Bayes rate {binomial_tail(49, 0.57, 25):.3f}" in out
    results = results_by_run(tmp_path)
    assert set(results) == {(entry, 1) for entry in entries}  # one run per entry (one seed)
    for entry in entries:
        folder = tmp_path / re.sub(r"[^A-Za-z0-9_.-]+", "_", entry).strip("_")
        right, examples = counted((folder / "test.log").read_text(), "test")
        validated = logged_accuracies((folder / "train.log").read_text(), "valid")
        assert examples == 64 and len(validated) == 1  # every test sequence counted; one epoch, one validation
        assert_counts_of(validated[0], 64)
        result = results[(entry, 1)]
        assert result["test"] == right / 64  # the run's own accuracy, exact
        # the best checkpoint's validation recounted: what fairseq-train logged, to its 0.1%
        assert result["valid_examples"] == 64 and abs(result["valid"] - validated[0]) <= 0.0005 + 1e-9
        test_cell, valid_cell, seeds = rows[f"`{entry}`"][:3]
        assert (test_cell, valid_cell, seeds) == (f"{result['test']:.3f}", f"{result['valid']:.3f}", "1/1")
    assert re.search(r"at5_length_scale.: 50|--at5-length-scale', '50'|--at5-length-scale 50",
                     (tmp_path / "roberta_at5_--at5-length-scale_50" / "train.log").read_text())


def test_negation_scope_data_follow_the_rule(tmp_path):
    """Labels are (word is good) XOR (`not` within SCOPE before it), balanced, and no word alone tells
    the class: only the distance does."""
    module = load_script(CLAIMS / "negation_scope.py")
    module.write_split(tmp_path, "train", 4000, random.Random(0))
    sequences = [line.split() for line in (tmp_path / "train.input0").read_text().splitlines()]
    labels = [int(line) for line in (tmp_path / "train.label").read_text().splitlines()]
    assert len(sequences) == 4000 and sum(labels) == 2000
    gaps = []
    for words, label in zip(sequences, labels):
        assert len(words) == module.LENGTH and words.count("not") == 1
        sentiment = [index for index, word in enumerate(words) if word in ("good", "bad")]
        assert len(sentiment) == 1
        gap = sentiment[0] - words.index("not")
        gaps.append(gap)
        assert label == int((words[sentiment[0]] == "good") != (gap <= 7)) == module.label_of(words)
    assert set(gaps) == set(range(1, 15))  # 1 .. 2 * SCOPE, both sides of the scope
    for word in ("good", "bad"):  # the sentiment word alone is no better than chance
        with_word = [label for words, label in zip(sequences, labels) if word in words]
        assert abs(sum(with_word) / len(with_word) - 0.5) < 0.03


@pytest.mark.slow
def test_negation_scope_runs_through_fairseq_with_the_reach_column(tmp_path):
    entries = ["roberta_nope", "roberta_lfhc:--lfhc-k 4"]
    out = run([sys.executable, CLAIMS / "negation_scope.py", "--out", tmp_path, "--train", "200", "--valid", "64",
               "--test", "64", "--epochs", "2", "--batch-size", "32", "--seeds", "1", "2", "--jobs", "2",
               "--arch", *entries], env={"PATH": str(BIN)})
    rows = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]]
            for row in out.splitlines() if row.startswith("| `")}
    assert set(rows) == {"`roberta_nope`", "`roberta_lfhc:--lfhc-k 4`"}
    assert "first epoch valid ≥ 0.9" in out
    for test, valid, reach, seeds, paper, minutes, device in rows.values():
        assert seeds == "2/2" and device == "cpu" and " ± " in test and 0 <= float(test.split(" ± ")[0]) <= 1
    assert rows["`roberta_lfhc:--lfhc-k 4`"][4] == "83.26"  # the paper's SST-2 number beside ours
    results = results_by_run(tmp_path)
    assert set(results) == {(entry, seed) for entry in entries for seed in (1, 2)}  # one run per entry and seed
    for entry in entries:
        tested, best_valid, reached = [], [], []
        for seed in (1, 2):
            folder = tmp_path / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', entry).strip('_')}_seed{seed}"
            right, examples = counted((folder / "test.log").read_text(), "test")
            curve = logged_accuracies((folder / "train.log").read_text(), "valid")
            assert examples == 64 and len(curve) == 2  # every test sequence counted; a validation per epoch
            for accuracy in curve:
                assert_counts_of(accuracy, 64)
            result = results[(entry, seed)]
            assert result["test"] == right / 64  # the run's own, exact
            assert result["valid_curve"] == pytest.approx(curve, abs=1e-9)  # as fairseq logged it
            assert abs(result["valid"] - max(curve)) <= 0.0005 + 1e-9  # the best checkpoint's, recounted
            tested.append(result["test"])
            best_valid.append(result["valid"])
            reached += [epoch for epoch, accuracy in enumerate(curve, start=1) if accuracy >= 0.9][:1]
        test, valid, reach = rows[f"`{entry}`"][:3]
        for cell, values in ((test, tested), (valid, best_valid)):  # mean ± sd (each seed's, in seed order)
            assert cell == (f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} "
                            f"({values[0]:.3f}, {values[1]:.3f})"), (entry, cell, values)
        assert reach == (f"{statistics.mean(reached):.1f} ({len(reached)}/2)" if reached else "never"), (entry, reach)
    for seed in (1, 2):  # one run per seed, each trained with its seed
        log = (tmp_path / f"roberta_lfhc_--lfhc-k_4_seed{seed}" / "train.log").read_text()
        assert f" --seed {seed} " in log.splitlines()[0]


def test_runner_reach_column_and_fairseq_module_fallback(tmp_path, monkeypatch):
    runner = load_script(CLAIMS / "runner.py")
    results = [{"entry": "a", "test": 0.5, "valid": 0.95, "valid_curve": [0.5, 0.91, 0.95], "minutes": 1.0,
                "device": "cuda"},
               {"entry": "a", "test": 0.7, "valid": 0.6, "valid_curve": [0.5, 0.6], "minutes": 3.0, "device": "cpu"},
               {"entry": "b"}]
    text = runner.table(results, "heading", {"a": "80"}, reach=0.9)
    row_a, row_b = [line for line in text.splitlines() if line.startswith("| `")]
    assert row_a == "| `a` | 0.600 ± 0.141 (0.500, 0.700) | 0.775 ± 0.247 (0.950, 0.600) | 2.0 (1/2) | 2/2 | 80 | 2.0 | cpu, cuda |"
    assert row_b == "| `b` | failed | failed | never | 0/1 |  |  |  |"
    assert runner.first_epoch_reaching([0.2, 0.9, 0.8], 0.9) == 2
    # an older record without valid accuracy and minutes: those columns say over how many runs
    older = [{"entry": "c", "test": 0.8, "valid": 0.9, "minutes": 2.0, "device": "cpu"},
             {"entry": "c", "test": 0.6, "device": "cpu"}]
    row_c = [line for line in runner.table(older, "h", {}).splitlines() if line.startswith("| `")][0]
    assert row_c == "| `c` | 0.700 ± 0.141 (0.800, 0.600) | 0.900 (1 of 2 runs) | 2/2 |  | 2.0 (1 of 2 runs) | cpu |"
    monkeypatch.setattr(runner, "BIN", tmp_path)  # no console scripts here
    monkeypatch.setenv("PATH", str(tmp_path))
    assert runner.fairseq_command("fairseq-validate") == [sys.executable, "-m", "fairseq_cli.validate"]


@pytest.mark.parametrize("option", ["--jobs", "--threads"])
def test_the_claims_refuse_fewer_than_one_job_before_writing_anything(tmp_path, capsys, option):
    for script in ("process50.py", "negation_scope.py"):
        with pytest.raises(SystemExit) as exit_info:
            load_script(CLAIMS / script).main(["--out", str(tmp_path / "out"), option, "0"])
        assert exit_info.value.code == 2 and f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_claims_refuse_an_out_folder_of_an_earlier_run(tmp_path):
    """Before, a second run into the same --out drew new data into raw/, then fairseq-preprocess ended in a
    traceback on the earlier bin/ (whose data stayed), or its results were appended to the earlier ones."""
    runner = load_script(CLAIMS / "runner.py")
    (tmp_path / "bin").mkdir()
    args = argparse.Namespace(out=tmp_path, threads=1)
    with pytest.raises(SystemExit, match=r"holds an earlier run \(bin\): give another --out or remove it"):
        runner.generate_and_run(args, [], lambda *arguments: pytest.fail("data drawn"))
    assert not (tmp_path / "raw").exists()


def test_runner_keeps_the_counts_of_right_answers(tmp_path, monkeypatch):
    """A run's accuracies are its counts of right answers (checkpoint_eval.py's, here canned), not the
    accuracies fairseq logs rounded to 0.1%; the validation curve stays as logged (the reach column)."""
    runner = load_script(CLAIMS / "runner.py")
    commands = []

    def fake_run(command, log, env):
        commands.append([str(part) for part in command])
        with open(log, "a") as out:
            if str(command[0]) == "fairseq-train":
                out.write("2024-01-01 00:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 0.5 | "
                          "accuracy 84.4 | wps 1 | num_updates 8\n")  # (fairseq-train's format)
            else:
                out.write("valid: 844 of 1000 correct (84.40%)\ntest: 4217 of 5000 correct (84.34%)\n")
    monkeypatch.setattr(runner, "run", fake_run)
    args = argparse.Namespace(cuda=False, lr=1e-3, batch_size=64, epochs=1)
    result = runner.train_and_test("roberta_t5", 1, tmp_path / "bin", tmp_path / "work", [], args, {})
    assert commands[1][:2] == [sys.executable, str(REPO / "examples" / "checkpoint_eval.py")]
    assert commands[1][commands[1].index("--subsets") + 1] == "valid,test" and "--cpu" in commands[1]
    assert result["test"] == 4217 / 5000 and (result["test_correct"], result["test_examples"]) == (4217, 5000)
    assert result["valid"] == 844 / 1000 and result["valid_curve"] == pytest.approx([0.844])  # as logged
    assert result["setup"] == {"epochs": 1, "batch_size": 64, "lr": 1e-3}  # what the record was run with


def test_plot_claims_needs_every_result_before_drawing_any(tmp_path, capsys):
    """Before, a --data with the Process-50 results alone drew its figure, then ended in a traceback."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "process50.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        load_script(CLAIMS / "plot_claims.py").main(["--data", str(data), "--out", str(tmp_path / "img")])
    assert exit_info.value.code == 2 and "negation_scope.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "img").exists()


def test_plot_claims_writes_its_doc_and_figures_whole_or_not_at_all(tmp_path, monkeypatch):
    """Before, the tables went through a fixed DOC.tmp, left half-written when the write failed, and a
    figure was saved in place: a failure midway left half of it instead of the earlier one."""
    import errno
    import os

    import matplotlib.figure

    plot_claims = load_script(CLAIMS / "plot_claims.py")
    doc, figure = tmp_path / "claims.md", tmp_path / "claim_short_to_long.png"
    doc.write_text("<!-- table:x -->\nearlier\n<!-- /table -->\n")
    figure.write_bytes(b"earlier figure")
    before = {path: path.read_bytes() for path in (doc, figure)}
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def half_text(self, text, *args, **kwargs):  # a disk that fills up halfway through
        write_text(self, text[:len(text) // 2], *args, **kwargs)
        raise full

    def half_figure(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half a figure")
        raise full
    write_text = Path.write_text
    monkeypatch.setattr(Path, "write_text", half_text)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_figure)
    with pytest.raises(OSError):
        plot_claims.write_tables(doc, {"x": "new\n"})
    with pytest.raises(OSError):
        plot_claims.plot_short_to_long({"bins": ["[3,16)"], "rows": {"t5": [[1.0, 2.0]]}}, figure)
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == before


@pytest.mark.slow
def test_short_to_long_runs_through_fairseq_and_reports_each_bin(tmp_path):
    """FLOATER paper, figure 2, at toy size: sinusoidal and the bounded FLOATER through the recipe's
    steps (split, prepare, train.sh, evaluate.py with and without the stop, report.py)."""
    script = REPO / "examples" / "claims" / "short_to_long.py"
    run([sys.executable, script, tmp_path, "--variants", "sinusoidal,floater_bounded", "--sentences", "120",
         "--per-bin", "4", "--max-update", "2", "--beam", "1"])
    report = (tmp_path / "s2l.md").read_text()
    for row in ("sinusoidal", "floater_bounded", "floater_bounded+stop17"):
        assert re.search(rf"^\|\s*{re.escape(row)}\s*\|", report, flags=re.M), (row, report)
    assert (tmp_path / "s2l.png").stat().st_size > 0


def test_short_to_long_run_again_redraws_other_sizes_and_trains_afresh(tmp_path, monkeypatch):
    """A second run in the same WORK with other --sentences draws its own data, and train.sh never
    resumes from the first run's checkpoint (it would train nothing and re-score the old model)."""
    s2l = load_script(REPO / "examples" / "claims" / "short_to_long.py")
    commands = []

    def fake_run(command, env=None):  # the steps' outputs that the next steps look for
        commands.append([str(part) for part in command])
        if command[1] == s2l.TRANSLATION / "prepare.py":
            (Path(command[3]) / "bin").mkdir(parents=True, exist_ok=True)
            (Path(command[3]) / "bin" / "dict.src.txt").write_text("a 1\n")
        if str(command[0]).endswith("train.sh"):
            assert not list(Path(command[2]).glob("checkpoint*.pt")), "train.sh would resume"
            Path(command[2]).mkdir(parents=True, exist_ok=True)
            (Path(command[2]) / "checkpoint_last.pt").write_text("trained")

    monkeypatch.setattr(s2l, "run", fake_run)
    sizes = []
    for sentences in (60, 200, 200):
        commands.clear()
        s2l.main([str(tmp_path), "--variants", "sinusoidal", "--sentences", str(sentences), "--per-bin", "2"])
        prepared = any(command[1].endswith("prepare.py") for command in commands)
        sizes.append((prepared, len((tmp_path / "raw" / "train.src").read_text().splitlines())))
    assert sizes == [(True, 60 + 3 * 2), (True, 200 + 3 * 2), (False, 200 + 3 * 2)]


def test_plot_claims_counts_each_sweep_run_once_and_one_set_up_only(tmp_path):
    """A line kept twice counts once (sweep.py's run key); a run of another budget is refused rather
    than pooled into the rates."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(REPO / "docs" / "data", data)
    kept = data / "process50_sweep.jsonl"
    lines = kept.read_text().splitlines()
    before = run([sys.executable, CLAIMS / "plot_claims.py", "--data", data, "--out", tmp_path / "a"])
    kept.write_text("\n".join(lines + lines[:1]) + "\n")
    assert run([sys.executable, CLAIMS / "plot_claims.py", "--data", data, "--out", tmp_path / "b"]) == before
    other = dict(json.loads(lines[0]), epochs=2, test=0.52)
    kept.write_text("\n".join(lines + [json.dumps(other)]) + "\n")
    done = subprocess.run([sys.executable, CLAIMS / "plot_claims.py", "--data", data, "--out", tmp_path / "c"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "keep one set-up per file" in done.stderr


def test_plot_claims_redraws_the_docs_figures_from_docs_data(tmp_path):
    """docs/claims.md's tables and plots come from the kept results: every run in docs/data is in a
    row, with the paper's number beside the paper's models."""
    out = run([sys.executable, CLAIMS / "plot_claims.py", "--out", tmp_path])
    for name in ("process50", "negation_scope", "short_to_long"):
        assert (tmp_path / f"claim_{name}.png").stat().st_size > 10_000
    runs = [line for line in (REPO / "docs" / "data" / "process50.jsonl").read_text().splitlines() if line]
    rows = [row for row in out.split("Negation scope")[0].splitlines() if row.startswith("| `")]
    assert sum(int(row.split("|")[4].split("/")[1]) for row in rows) == len(runs)  # "done/runs" per entry
    assert re.search(r"^\| `roberta_at5` \| [0-9.]+ ± [0-9.]+ \([0-9., ]+\) \|.*\| 0\.843 \|", out, flags=re.M)
    assert re.search(r"^\| `roberta_gcdf` \| .*\| 84\.63 \|", out, flags=re.M)
    assert "| `transformer_sinusoidal` | 78.1 / 79.5 / 82.3 [80.0] |" in out
    swept = [json.loads(line) for line in (REPO / "docs" / "data" / "process50_sweep.jsonl").read_text().splitlines()
             if line.strip()]
    assert (tmp_path / "claim_process50_sweep.png").stat().st_size > 10_000
    table = out.split("Process-50 sweep")[1].split("BLEU per source-length bin")[0]
    counts = [int(runs) for runs in re.findall(r"\d+/(\d+) \([0-9.]+\)", table)]  # "left/runs (mean)" per cell
    assert sum(counts) == sum(run["test"] is not None for run in swept)
