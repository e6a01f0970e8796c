"""The new-user scripts: scripts/compare.py (train several encodings, one table and one plot),
scripts/options.py (every encoding's options), the demo's layout, and that importing the plugin
leaves logging alone."""
import csv
import re
import subprocess
import sys

import pytest

from util import QUICK_TRAIN, REPO, TINY_ROBERTA, TINY_TRANSFORMER, run

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
    assert lines[0].startswith("| arch | params | train s | valid loss | BLEU (test) | 1-6 words | 7-9 words | >9 words |")
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
         "roberta_bogus", "--out", str(tmp_path), "--quiet", "--", "--task", "masked_lm", "--criterion", "masked_lm",
         "--tokens-per-sample", "64", *TINY_ROBERTA, *TRAIN, "--max-update", "2"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]  # one architecture failed
    table = (tmp_path / "results.md").read_text()
    assert "| arch | params | train s | valid loss | perplexity (valid) |" in table
    ppl = float(re.search(r"\| roberta_alibi \|[^|]+\|[^|]+\|[^|]+\| ([0-9.]+) \|", table).group(1))
    assert ppl > 1
    assert "| roberta_bogus | failed: fairseq-train failed" in table


def test_compare_refuses_training_without_an_end(translation_data, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "compare.py"), str(translation_data), "--arch",
                           "transformer_alibi", "--out", str(tmp_path), "--", *TINY_TRANSFORMER],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-update N or --max-epoch N" in done.stderr


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


def test_importing_the_plugin_leaves_logging_alone():
    code = ("import logging; before = (logging.getLogger().level, len(logging.getLogger().handlers)); "
            "import posenc_fairseq, fairseq.models.transformer; "
            "print(before == (logging.getLogger().level, len(logging.getLogger().handlers)))")
    assert run([sys.executable, "-c", code]).strip().endswith("True")


def test_demo_refuses_half_precision_on_cpu_and_cuda_without_a_gpu():
    import torch

    demo = [sys.executable, str(REPO / "examples" / "demo" / "run_demo.py")]
    done = subprocess.run(demo + ["--fp16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--fp16/--bf16 need --device cuda" in done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run(demo + ["--device", "cuda"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "sees no CUDA GPU" in done.stderr
