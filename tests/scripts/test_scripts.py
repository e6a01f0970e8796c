"""The new-user scripts: scripts/compare.py (train several encodings, one table and one plot),
scripts/options.py (every encoding's options), the demo's layout, and that importing the plugin
leaves logging alone."""
import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from util import QUICK_TRAIN, REPO, TINY_ROBERTA, TINY_TRANSFORMER, load_script, run, sigterm_handler_of

SCRIPTS = REPO / "scripts"
TRAIN = [option for option in QUICK_TRAIN if option != "--cpu"]  # compare.py adds --cpu itself


@pytest.mark.slow
def test_compare_two_encodings_on_translation(translation_data, tmp_path):
    out = run([sys.executable, SCRIPTS / "compare.py", translation_data, "--arch", "transformer_alibi",
               "transformer_t5", "--out", tmp_path, "--length-bins", "6,9", "--quiet", "--",
               *TINY_TRANSFORMER, *TRAIN, "--max-update", "3"])
    table = (tmp_path / "results.md").read_text()
    assert table in out  # printed as well
    lines = table.splitlines()
    assert lines[0].startswith("Commit ") and lines[1] == ""  # what made the table, then the table
    assert lines[2].startswith("| arch | params | train s | valid loss | BLEU (test) | 0-6 words | 7-9 words | >9 words |")
    rows = [line for line in lines if line.startswith("| transformer_")]
    assert [row.split(" | ")[0] for row in rows] == ["| transformer_alibi", "| transformer_t5"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert int(cells[1].replace(",", "")) > 0 and 0 <= float(cells[4]) <= 100
        counts = [int(re.search(r"\((\d+)\)", cell).group(1)) for cell in cells[5:]]
        assert sum(counts) == 20  # every test sentence is in one bin
    assert (tmp_path / "compare.png").stat().st_size > 1000
    with open(tmp_path / "results.csv") as handle:
        assert [row["arch"] for row in csv.DictReader(handle)] == ["transformer_alibi", "transformer_t5"]
    for arch in ("transformer_alibi", "transformer_t5"):
        assert (tmp_path / arch / "checkpoints" / "checkpoint_last.pt").exists()
        assert "Translated 20 sentences" in (tmp_path / arch / "generate.txt").read_text()


@pytest.mark.slow
def test_compare_masked_lm_reports_perplexity_and_survives_a_failure(masked_lm_data, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "compare.py"), str(masked_lm_data), "--arch", "roberta_alibi",
         "transformer_alibi", "--out", str(tmp_path), "--quiet", "--", "--task", "masked_lm", "--criterion", "masked_lm",
         "--tokens-per-sample", "64", *TINY_ROBERTA, *TRAIN, "--max-update", "2"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]  # one architecture failed
    table = (tmp_path / "results.md").read_text()
    assert "| arch | params | train s | valid loss | perplexity (valid) |" in table
    ppl = float(re.search(r"\| roberta_alibi \|[^|]+\|[^|]+\|[^|]+\| ([0-9.]+) \|", table).group(1))
    assert ppl > 1
    # (an encoder-decoder on masked_lm: an architecture fairseq knows, whose training fails)
    assert "| transformer_alibi | failed: fairseq-train failed" in table


def test_compare_refuses_training_without_an_end(translation_data, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "compare.py"), str(translation_data), "--arch",
                           "transformer_alibi", "--out", str(tmp_path), "--", *TINY_TRANSFORMER],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-update N or --max-epoch N" in done.stderr


@pytest.fixture(scope="module")
def compare():
    from util import load_script

    return load_script(SCRIPTS / "compare.py")


def test_compare_length_bins_hold_every_sentence_and_score_the_best_hypothesis(compare):
    """fairseq-generate's output (its format, --nbest 2: hypotheses best first) with a 0-word source."""
    output = "\n".join([
        "S-0\t", "T-0\tempty source gives this", "H-0\t-0.1\tempty source gives this",
        "D-0\t-0.1\tempty source gives this", "D-0\t-0.9\tsomething worse",
        "S-1\ta b c", "T-1\tthree words here", "H-1\t-0.1\tthree words here", "D-1\t-0.1\tthree words here",
        "D-1\t-0.9\tbanana",
        "S-2\ta b c d e f g", "T-2\tseven word source sentence translated ok",
        "H-2\t-0.1\tseven word source sentence translated ok", "D-2\t-0.1\tseven word source sentence translated ok",
    ]) + "\n"
    bins = compare.bleu_by_length(output, [5])
    assert [(label, count) for label, _, count in bins] == [("0-5", 2), (">5", 1)]  # all 3 sentences
    assert all(score == pytest.approx(100.0) for _, score, _ in bins)


def test_compare_reports_the_loss_where_a_classifier_logs_no_accuracy(compare, monkeypatch, tmp_path):
    """sentence_prediction with --regression-target: fairseq-validate logs loss and nll_loss only."""
    monkeypatch.setattr(compare, "stored_task", lambda checkpoint: ("sentence_prediction", "sentence_prediction"))

    def fake_validate(command, output, **kwargs):
        Path(output).write_text("INFO | valid | valid on 'valid' subset | loss 0.412 | nll_loss 0.412 | wps 1000 | "
                                "wpb 50 | bsz 8\n")
    monkeypatch.setattr(compare.DEMO, "run", fake_validate)
    args = argparse.Namespace(data=tmp_path, subset=None, quiet=True, length_bins=None, generate_args="")
    result = compare.evaluate(args, "roberta_t5", tmp_path, tmp_path / "checkpoint.pt", {}, ["--cpu"])
    assert result == {"metric": "loss (valid)", "value": 0.412, "bins": []}


def test_compare_reports_an_unexpected_failure_and_runs_the_other_architectures(compare, monkeypatch, tmp_path,
                                                                                 capsys):
    trained = []

    def train_and_evaluate(args, arch, env, device):
        trained.append(arch)
        if arch == "roberta_t5":
            raise KeyError("ppl")  # e.g. a log this script cannot read
        return {"arch": arch, "metric": "accuracy % (valid)", "value": 75.0, "bins": [], "params": 1000,
                "train_seconds": 1.0, "valid_loss": 0.5}
    monkeypatch.setattr(compare, "train_and_evaluate", train_and_evaluate)
    (tmp_path / "data").mkdir()
    status = compare.main([str(tmp_path / "data"), "--arch", "roberta_t5", "roberta_alibi", "--out",
                           str(tmp_path / "out"), "--", "--max-update", "1"])
    assert status == 1 and trained == ["roberta_t5", "roberta_alibi"]
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| roberta_t5 | failed: KeyError: 'ppl' |" in table
    assert "| roberta_alibi | 1,000 | 1 | 0.500 | 75.0 |" in table
    assert "KeyError" in (tmp_path / "out" / "roberta_t5" / "error.log").read_text()
    assert "roberta_t5: KeyError: 'ppl'" in capsys.readouterr().out


def test_compare_reads_options_written_with_an_equals_sign(compare, tmp_path, capsys):
    """`--max-update=500` is a training length, `--save-dir=X` is compare.py's own option."""
    (tmp_path / "data").mkdir()
    common = [str(tmp_path / "data"), "--arch", "transformer_t5", "--out", str(tmp_path / "out"), "--"]
    assert compare.parse_args([*common, "--max-update=500"]).train_options == ["--max-update=500"]
    with pytest.raises(SystemExit):
        compare.parse_args([*common, "--max-update", "5", "--save-dir=elsewhere"])
    assert "--save-dir is set by compare.py" in capsys.readouterr().err
    # fairseq's short alias and an abbreviation would replace every row's architecture
    for other_arch in (["-a", "transformer_sinusoidal"], ["--ar", "transformer_sinusoidal"]):
        with pytest.raises(SystemExit):
            compare.parse_args([*common, "--max-update", "5", *other_arch])
        assert "--arch is set by compare.py" in capsys.readouterr().err
    assert compare.parse_args([*common, "--max-up", "5"]).train_options == ["--max-up", "5"]


def test_compare_demo_preset_keeps_sentencepiece_under_the_users_generate_args(compare, tmp_path):
    """With --preset demo the demo's generate options (sentencepiece removed before scoring) come
    first and the user's after them, not instead of them (BLEU on pieces otherwise)."""
    (tmp_path / "data" / "bin").mkdir(parents=True)
    (tmp_path / "data" / "spm").mkdir()
    (tmp_path / "data" / "spm" / "spm.model").write_text("")
    args = compare.parse_args([str(tmp_path / "data" / "bin"), "--arch", "transformer_t5", "--preset", "demo",
                               "--out", str(tmp_path / "out"),
                               "--generate-args", "--nbest 1 --max-len-b 5", "--", "--max-update", "5"])
    generate = args.generate_args.split()
    assert generate[generate.index("--bpe") + 1] == "sentencepiece"
    assert generate[-4:] == ["--nbest", "1", "--max-len-b", "5"]  # the user's last: they win


def test_compare_run_again_leaves_no_stale_error_log(compare, monkeypatch, tmp_path):
    outcomes = iter([KeyError("ppl"), None])

    def train_and_evaluate(args, arch, env, device):
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome
        return {"arch": arch, "metric": "accuracy % (valid)", "value": 75.0, "bins": [], "params": 1000,
                "train_seconds": 1.0, "valid_loss": 0.5}
    monkeypatch.setattr(compare, "train_and_evaluate", train_and_evaluate)
    (tmp_path / "data").mkdir()
    argv = [str(tmp_path / "data"), "--arch", "roberta_t5", "--out", str(tmp_path / "out"), "--", "--max-update", "1"]
    assert compare.main(argv) == 1 and (tmp_path / "out" / "roberta_t5" / "error.log").exists()
    assert compare.main(argv) == 0 and not (tmp_path / "out" / "roberta_t5" / "error.log").exists()


def test_compare_interrupted_keeps_what_finished_and_no_earlier_table(compare, monkeypatch, tmp_path):
    """Ctrl-C during the second architecture: the table holds the first and says where it stopped;
    an earlier run's table and plot never stand as this run's."""
    def train_and_evaluate(args, arch, env, device):
        if arch == "roberta_xl":
            raise KeyboardInterrupt
        return {"arch": arch, "metric": "accuracy % (valid)", "value": 75.0, "bins": [], "params": 1000,
                "train_seconds": 1.0, "valid_loss": 0.5}
    monkeypatch.setattr(compare, "train_and_evaluate", train_and_evaluate)
    (tmp_path / "data").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.md", "results.csv", "compare.png"):
        (out / name).write_text("an earlier run's")
    argv = [str(tmp_path / "data"), "--arch", "roberta_t5", "roberta_xl", "--out", str(out), "--", "--max-update", "1"]
    assert compare.main(argv) == 130
    table = (out / "results.md").read_text()
    assert "| roberta_t5 |" in table and "Interrupted while running roberta_xl" in table
    assert "an earlier run's" not in (out / "results.csv").read_text()
    assert compare.main([*argv[:2], "roberta_xl", *argv[3:]]) == 130  # nothing finished: no table at all
    assert not any((out / name).exists() for name in ("results.md", "results.csv", "compare.png"))


def fake_compare(compare, monkeypatch, tmp_path, outcomes, data=None):
    """compare.main on --arch `outcomes` (arch -> accuracy, or an exception its evaluation raises) with
    training and evaluation faked; returns (exit status, the plot's axis titles)."""
    def evaluate(args, arch, work, checkpoint, env, device):
        if isinstance(outcomes[arch], Exception):
            raise outcomes[arch]
        return {"metric": "accuracy % (valid)", "value": outcomes[arch], "bins": []}
    monkeypatch.setattr(compare.DEMO, "run", lambda command, log, **kwargs: None)
    monkeypatch.setattr(compare, "evaluate", evaluate)
    import matplotlib.figure

    titles, savefig = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda figure, *a, **k: (titles.extend(axis.get_title() for axis in figure.axes),
                                                 savefig(figure, *a, **k))[1])
    if data is None:
        data = tmp_path / "data"
        data.mkdir()
    status = compare.main([str(data), "--arch", *outcomes, "--out", str(tmp_path / "out"), "--", "--max-update", "1"])
    return status, titles


def test_compare_says_when_a_rerun_removes_the_earlier_checkpoints(compare, monkeypatch, tmp_path, capsys):
    """Before, an earlier run's DIR/ARCH/checkpoints went without a word."""
    earlier = tmp_path / "out" / "roberta_t5" / "checkpoints"
    earlier.mkdir(parents=True)
    (earlier / "checkpoint_last.pt").write_text("an earlier run's")
    assert fake_compare(compare, monkeypatch, tmp_path, {"roberta_t5": 75.0})[0] == 0
    assert f"roberta_t5: removing an earlier run's checkpoints in {earlier}" in capsys.readouterr().out
    assert not earlier.exists()
    assert "A rerun into the same DIR replaces DIR/ARCH" in " ".join(compare.__doc__.split())  # --help says so


def test_compare_refuses_data_in_a_folder_a_run_removes(compare, monkeypatch, tmp_path, capsys):
    """Before, DATA-BIN inside DIR/ARCH/checkpoints was deleted with the earlier run's checkpoints."""
    for data in (tmp_path / "out" / "roberta_t5" / "checkpoints" / "bin", tmp_path / "out" / "roberta_t5" / "checkpoints"):
        data.mkdir(parents=True, exist_ok=True)
        (data / "dict.txt").write_text("the data")
        with pytest.raises(SystemExit) as exit_info:
            fake_compare(compare, monkeypatch, tmp_path, {"roberta_alibi": 75.0, "roberta_t5": 75.0}, data=data)
        assert exit_info.value.code == 2 and (data / "dict.txt").read_text() == "the data"
        assert "roberta_t5/checkpoints, which a run removes: give another --out" in capsys.readouterr().err


def test_compare_records_what_made_the_results_and_names_the_failed_in_the_plot(compare, monkeypatch, tmp_path,
                                                                              capsys):
    """Before, results.md and results.csv said nothing of the commit or the command, the plot left a
    failed architecture out without a word, and an accuracy fairseq logs to 0.1 was shown as 75.00."""
    from posenc_fairseq.provenance import source_commit

    status, titles = fake_compare(compare, monkeypatch, tmp_path,
                                  {"roberta_t5": 75.0, "roberta_alibi": compare.DEMO.CommandFailed("fairseq-train failed")})
    assert status == 1
    command = f"scripts/compare.py {tmp_path / 'data'} --arch roberta_t5 roberta_alibi --out {tmp_path / 'out'} -- --max-update 1"
    table = (tmp_path / "out" / "results.md").read_text()
    assert table.splitlines()[0] == f"Commit {source_commit()}: `{command}`; fairseq-train options `--max-update 1`"
    with open(tmp_path / "out" / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["arch"] for row in rows] == ["roberta_t5", "roberta_alibi"]
    assert all(row["commit"] == source_commit() and row["command"] == command and row["train_options"] == "--max-update 1"
               for row in rows)
    assert titles[0] == "failed: roberta_alibi"
    assert "| roberta_t5 | ? | 0 | - | 75.0 |" in table and "accuracy % (valid) = 75.0\n" in capsys.readouterr().out


def options_output(capsys, *argv):
    """scripts/options.py run in this process (fairseq is imported already: no start-up cost)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("options_script", SCRIPTS / "options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    module.main(list(argv))
    return capsys.readouterr().out


def test_options_lists_every_option_of_every_encoding_with_a_default(capsys):
    import argparse

    from posenc_fairseq.encodings import ENCODINGS

    out = options_output(capsys)
    for name, cls in ENCODINGS.items():
        assert re.search(rf"^{name}  \(architectures transformer_{name}\*", out, flags=re.M), name
        parser = argparse.ArgumentParser()
        cls.add_args(parser)
        section = out.split(f"\n{name}  (")[1].split("\n\n")[0]
        for action in parser._actions[1:]:  # [0] is --help
            flag = action.option_strings[0]
            found = re.search(rf"^    {re.escape(flag)}\b.*\n        default: (.+)$", section, flags=re.M)
            assert found, f"{name}: {flag} missing"
            assert found.group(1) not in ("see below", ""), f"{name}: {flag} has no stated default"
    assert "default: 32" in out.split("\nt5  (")[1]
    one = options_output(capsys, "alibi")
    assert "no options of its own" in one and "floater" not in one.split("alibi  (")[1]
    with pytest.raises(SystemExit) as exit_info:
        options_output(capsys, "bogus")
    assert exit_info.value.code == 2 and "unknown encoding(s) bogus" in capsys.readouterr().err
    # and as a command
    assert "--floater-method rk4|midpoint|euler|dopri5" in run([sys.executable, SCRIPTS / "options.py", "floater"])


def test_options_lists_every_common_option_the_models_have(capsys):
    """The options every architecture adds (models/common.py `add_position_args`), help hidden ones aside."""
    import argparse

    from posenc_fairseq.encodings import ENCODINGS
    from posenc_fairseq.models.common import add_position_args

    parser = argparse.ArgumentParser(add_help=False)
    add_position_args(parser)
    own = {flag for kind in ENCODINGS.values() for flag in _flags_of(kind.add_args)}
    common = [action.option_strings[0] for action in parser._actions
              if action.help != argparse.SUPPRESS and action.option_strings[0] not in own]
    listed = options_output(capsys).split("\n\n")[0]
    assert common and all(re.search(rf"^    {re.escape(flag)}\b", listed, flags=re.M) for flag in common), listed


def _flags_of(add_args):
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return [action.option_strings[0] for action in parser._actions]


def test_compare_sigterm_ends_a_run_as_ctrl_c_does():
    """Before, SIGTERM (kill, a job scheduler's stop) ended compare.py at once: no table of the
    architectures that had finished, which Ctrl-C writes."""
    assert sigterm_handler_of(SCRIPTS / "compare.py") == "posenc_fairseq.cli_signals"


def test_importing_the_plugin_leaves_logging_alone():
    code = ("import logging; before = (logging.getLogger().level, len(logging.getLogger().handlers)); "
            "import posenc_fairseq, fairseq.models.transformer; "
            "print(before == (logging.getLogger().level, len(logging.getLogger().handlers)))")
    assert run([sys.executable, "-c", code]).strip().endswith("True")


def test_compare_counts_words_of_sentencepiece_and_bpe_sources(compare):
    """--length-bins are in words, whatever the data's subword tokens: fairseq-generate prints the
    source (S-i) as the binarised data's tokens."""
    assert compare.words_in("\u2581pego \u2581mi b a \u2581ba") == 3
    assert compare.words_in("pe@@ go mi@@ b@@ a ba") == 3
    assert compare.words_in("pego miba ba") == 3 and compare.words_in("") == 0
    output = "S-0\t\u2581a b \u2581c d e \u2581f\nT-0\tx y\nD-0\t-0.1\tx y\n"
    assert [(label, count) for label, _, count in compare.bleu_by_length(output, [3])] == [("0-3", 1), (">3", 0)]


def test_compare_reports_the_validation_of_the_model_it_scores(compare):
    """fairseq-train validates at the end of training only where the epoch asks for it (--validate-interval):
    an earlier validation is another model's, so it is not reported as the run's valid loss."""
    def log(*lines):
        return "\n".join(f"2026-11-29 | INFO | {line}" for line in lines)

    valid = "valid | epoch 00{} | valid on 'valid' subset | loss {} | ppl 9 | wps 1 | num_updates {}"
    train = "train | epoch 00{} | loss 7 | ppl 9 | wps 1 | num_updates {} | lr 0.1"
    assert compare.last_valid_loss(log(train.format(1, 10), valid.format(2, "5.819", 20), train.format(2, 20),
                                       train.format(3, 30))) is None
    assert compare.last_valid_loss(log(valid.format(3, "5.5", 30), train.format(3, 30))) == 5.5
    assert compare.last_valid_loss(log(train.format(1, 10))) is None


@pytest.mark.parametrize("ends", [["--max-update", "0"], ["--max-epoch=0"], ["--max-update", "0", "--max-epoch", "0"]])
def test_compare_refuses_a_training_length_fairseq_reads_as_no_limit(compare, translation_data, tmp_path, ends, capsys):
    with pytest.raises(SystemExit):
        compare.parse_args([str(translation_data), "--arch", "transformer_alibi", "--out", str(tmp_path), "--", *ends])
    assert "--max-update N or --max-epoch N (N > 0)" in capsys.readouterr().err
    compare.parse_args([str(translation_data), "--arch", "transformer_alibi", "--out", str(tmp_path), "--",
                        *ends, "--max-update", "3"])


def test_compare_refuses_an_unknown_architecture_or_a_file_as_out_before_training(compare, translation_data,
                                                                                   tmp_path, capsys):
    """Before, a misspelt second architecture was found after the first one had trained, and --out
    naming a file ended in a traceback."""
    ends = ["--", "--max-update", "3"]
    with pytest.raises(SystemExit):
        compare.parse_args([str(translation_data), "--arch", "transformer_alibi", "transformer_t55",
                            "--out", str(tmp_path), *ends])
    assert "unknown architecture transformer_t55" in capsys.readouterr().err
    (tmp_path / "results").write_text("")
    with pytest.raises(SystemExit):
        compare.parse_args([str(translation_data), "--arch", "transformer_alibi", "--out", str(tmp_path / "results"),
                            *ends])
    assert "is a file: give a folder" in capsys.readouterr().err


def test_demo_refuses_half_precision_on_cpu_and_cuda_without_a_gpu():
    import torch

    demo = [sys.executable, str(REPO / "examples" / "demo" / "run_demo.py")]
    done = subprocess.run(demo + ["--fp16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--fp16/--bf16 need --device cuda" in done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run(demo + ["--device", "cuda"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "sees no CUDA GPU" in done.stderr


def test_compare_refuses_cuda_without_a_gpu(compare, translation_data, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is there")
    with pytest.raises(SystemExit):
        compare.parse_args([str(translation_data), "--arch", "transformer_alibi", "--out", str(tmp_path),
                            "--device", "cuda", "--", "--max-update", "3"])
    assert "--device cuda: torch" in capsys.readouterr().err


def test_a_stopped_demo_or_compare_run_stops_its_command(tmp_path):
    """run_demo.run (also compare.py's) interrupted while its command runs (Ctrl-C, or a SIGTERM that
    compare.py's handler turns into KeyboardInterrupt, sent to it alone) ends the command too; before,
    Popen's exit left fairseq-train running."""
    import time

    demo = load_script(REPO / "examples" / "demo" / "run_demo.py")
    command = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]
    started = []

    def stop_at_first_line(line):
        started.append(int(line))
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        demo.run(command, tmp_path / "log.txt", show=stop_at_first_line)
    deadline = time.time() + 30
    while time.time() < deadline and os.path.exists(f"/proc/{started[0]}") and \
            open(f"/proc/{started[0]}/stat").read().split()[2] != "Z":
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{started[0]}") or open(f"/proc/{started[0]}/stat").read().split()[2] == "Z"
