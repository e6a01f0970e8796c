"""scripts/gpu_check.py, the acceptance run on one GPU, run here as --device cpu: every check prints
its table, the CUDA-only comparisons are skipped, every other row passes; a difference or an error
becomes a FAIL row and exit status 1 while the other checks still run."""
import os
import subprocess
import sys

import pytest
import torch

from posenc_fairseq.encodings import ENCODINGS
from util import REPO, load_script

SCRIPT = REPO / "scripts" / "gpu_check.py"
CHECK_KEYS = "abcdefg"

def tables(output):
    """{check key: [(first cell, status, detail)]} from the markdown the script prints."""
    found, key, header_seen = {}, None, False
    for line in output.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            key = heading[0] if heading[1:2] == "." and heading[0] in CHECK_KEYS else None
            header_seen = False
            if key:
                found[key] = []
        elif key and line.startswith("|") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not header_seen:  # the column names
                header_seen = True
                assert cells[-2:] == ["status", "detail"], line
                continue
            found[key].append((cells[0], cells[-2], cells[-1]))
    return found


@pytest.fixture(scope="module")
def cpu_run():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick"], capture_output=True, text=True,
                          env=env, timeout=600)
    return done


def test_cpu_run_prints_every_table_and_passes_what_the_cpu_can_check(cpu_run):
    output = cpu_run.stdout
    assert "| torch | " + torch.__version__ in output and "| device | cpu |" in output
    found = tables(output)
    assert sorted(found) == list(CHECK_KEYS), cpu_run.stderr[-3000:]
    for key in CHECK_KEYS:
        assert f"## {key}." in output and "elapsed" in output.split(f"## {key}.")[1].split("## ")[0]
    every = sorted(ENCODINGS)
    assert [row[0] for row in found["a"]] == every
    assert [row[0] for row in found["c"]] == every
    assert [row[0] for row in found["g"]] == every
    assert [row[0] for row in found["d"]][:len(every)] == every
    # one of each kind of table (quick), then half-precision models (CUDA only) and fully padded rows
    assert {row[0] for row in found["b"]} == {"t5", "alibi", "xl", "lfhc", "shaw", "t5, bfloat16 model",
                                              "xl, float16 model", "alibi, a source row all padding",
                                              "xl, a source row all padding"}
    assert {row[1] for row in found["b"] if "model" in row[0]} == {"SKIP"}
    assert [row[1] for row in found["e"]] == ["PASS", "INFO"]
    assert {row[1] for row in found["f"]} == {"SKIP"}  # CUDA only
    failures = []
    for key, rows in found.items():
        for label, status, detail in rows:
            if key == "f" or (key, status) == ("e", "INFO") or (key == "b" and "model" in label):
                continue
            if status != "PASS":
                failures.append((key, label, status, detail))
    assert not failures, f"{failures}\n{cpu_run.stderr[-3000:]}"
    any_failed = any(status == "FAIL" for rows in found.values() for _, status, _ in rows)
    assert cpu_run.returncode == (1 if any_failed else 0)
    assert ("FAILED:" in output) == any_failed


def test_a_gradient_that_differs_fails_its_row(capsys, monkeypatch):
    """Check a compares each gradient: one parameter's gradient moved by 1e-3 of the largest on
    the compared side (float32 here) fails that row, and the exit status is 1."""
    gpu_check = load_script(SCRIPT)
    step = gpu_check.step

    def shifted(models, model, batch, *args, **kwargs):
        loss, logits, grads = step(models, model, batch, *args, **kwargs)
        if next(model.parameters()).dtype == torch.float32 and "positional_encoding.tables.encoder" in grads:
            scale = max(gradient.abs().max() for gradient in grads.values())
            grads["positional_encoding.tables.encoder"][0, 0] += 1e-3 * scale
        return loss, logits, grads

    monkeypatch.setattr(gpu_check, "step", shifted)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "a"]) == 1
    rows = {label: (status, detail) for label, status, detail in tables(capsys.readouterr().out)["a"]}
    assert rows["t5"][0] == "FAIL" and "limit" in rows["t5"][1]
    assert rows["sinusoidal"][0] == rows["alibi"][0] == "PASS"


def test_an_error_or_a_spent_budget_is_a_fail_row_and_the_other_checks_run(capsys, monkeypatch):
    gpu_check = load_script(SCRIPT)

    def broken(models, budget):
        raise RuntimeError("the check itself broke")

    monkeypatch.setitem(gpu_check.RUNNERS, "f", broken)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "f,e", "--budget", "e=0"]) == 1
    output = capsys.readouterr().out
    found = tables(output)
    assert found["f"] == [("f", "FAIL", "RuntimeError: the check itself broke")]
    assert [row[1] for row in found["e"]] == ["FAIL", "FAIL"]
    assert all("time budget" in row[2] for row in found["e"])
    assert "FAILED: 3 rows" in output


def test_a_decoding_step_that_differs_fails_its_row(capsys, monkeypatch):
    """Check g compares the steps with the pass: steps moved by 1e-3 of a log-probability fail."""
    gpu_check = load_script(SCRIPT)
    stepwise_and_full = gpu_check.stepwise_and_full

    def shifted(model, *args):
        full, stepwise = stepwise_and_full(model, *args)
        if model.positional_encoding.__class__.__name__.lower().startswith("t5"):
            stepwise = stepwise + 1e-3 * stepwise.abs().max()
        return full, stepwise

    monkeypatch.setattr(gpu_check, "stepwise_and_full", shifted)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "g"]) == 1
    rows = {label: (status, detail) for label, status, detail in tables(capsys.readouterr().out)["g"]}
    assert rows["t5"][0] == "FAIL" and "float32 steps: limit" in rows["t5"][1]
    assert rows["sinusoidal"][0] == rows["xl"][0] == "PASS"


def test_the_device_setup_script_runs_the_command_where_fairseq_imports():
    """scripts/gpu_device_setup.sh adds nothing where fairseq already imports, reports what it found
    (its last line imports the package and FLOATER's solver) and runs the command."""
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", "scripts/gpu_device_setup.sh", sys.executable, "-c", "print('ran')"], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ran"
    assert "gpu_device_setup: torch " + torch.__version__ in done.stderr and "floater extension:" in done.stderr
