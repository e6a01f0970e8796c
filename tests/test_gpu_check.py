"""scripts/gpu_check.py, what only a GPU shows (FlexAttention's calls and compiles, FLOATER's cost), run
here as --device cpu: every check prints its table, the CUDA-only rows are skipped, every other row passes;
a difference or an error becomes a FAIL row and exit status 1 while the other checks still run. (The
comparisons on CUDA are the test suite's: tests/devices.py.)"""
import os
import subprocess
import sys

import pytest
import torch

from util import REPO, load_script

SCRIPT = REPO / "scripts" / "gpu_check.py"
CHECK_KEYS = "be"

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
    # one of each kind of table (quick), then half-precision models (CUDA only) and fully padded rows
    assert {row[0] for row in found["b"]} == {"t5", "alibi", "xl", "lfhc", "shaw", "t5, bfloat16 model",
                                              "xl, float16 model", "alibi, a source row all padding",
                                              "xl, a source row all padding"}
    assert {row[1] for row in found["b"] if "model" in row[0]} == {"SKIP"}
    assert [row[1] for row in found["e"]] == ["INFO"]
    failures = []
    for key, rows in found.items():
        for label, status, detail in rows:
            if (key, status) == ("e", "INFO") or (key == "b" and "model" in label):
                continue
            if status != "PASS":
                failures.append((key, label, status, detail))
    assert not failures, f"{failures}\n{cpu_run.stderr[-3000:]}"
    any_failed = any(status == "FAIL" for rows in found.values() for _, status, _ in rows)
    assert cpu_run.returncode == (1 if any_failed else 0)
    assert ("FAILED:" in output) == any_failed


def test_flexattention_logits_that_differ_fail_its_row(capsys, monkeypatch):
    """Check b compares FlexAttention with the reference path: its output moved by 1e-3 of the largest
    entry fails the rows that take it, and the exit status is 1. (One encoding, to keep it short.)"""
    from posenc_fairseq.kernels import flex as flex_attention

    gpu_check = load_script(SCRIPT)
    attend = flex_attention.attend

    def shifted(*args, **kwargs):
        out = attend(*args, **kwargs)
        return out + 1e-3 * out.abs().max()

    monkeypatch.setattr(flex_attention, "attend", shifted)
    monkeypatch.setattr(gpu_check, "FLEX_FIRST", ["alibi"])
    monkeypatch.setattr(gpu_check, "FLEX_MASKED", ["alibi"])
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "b"]) == 1
    rows = {label: (status, detail) for label, status, detail in tables(capsys.readouterr().out)["b"]}
    assert rows["alibi"][0] == "FAIL" and "limit" in rows["alibi"][1]
    assert rows["alibi, a source row all padding"][0] == "FAIL"
    assert {status for label, (status, _) in rows.items() if "model" in label} == {"SKIP"}


def test_an_error_or_a_spent_budget_is_a_fail_row_and_the_other_checks_run(capsys, monkeypatch):
    gpu_check = load_script(SCRIPT)

    def broken(models, budget):
        raise RuntimeError("the check itself broke")

    monkeypatch.setitem(gpu_check.RUNNERS, "b", broken)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "b,e", "--budget", "e=0"]) == 1
    output = capsys.readouterr().out
    found = tables(output)
    assert found["b"] == [("b", "FAIL", "RuntimeError: the check itself broke")]
    assert [row[1] for row in found["e"]] == ["FAIL"]
    assert all("time budget" in row[2] for row in found["e"])
    assert "FAILED: 2 rows" in output


def test_the_removed_checks_are_refused_with_the_list_of_those_left(capsys):
    """a, c, d, f, g are the test suite's now (--device cuda): asking for one is a usage error."""
    gpu_check = load_script(SCRIPT)
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--device", "cpu", "--only", "a"])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "unknown checks ['a']; expected some of b, e; a, c, d, f, g are the test " \
                                     "suite's now: make test-cuda" in error


def test_the_device_setup_script_runs_the_command_where_fairseq_imports():
    """scripts/gpu_device_setup.sh adds nothing where fairseq already imports, reports what it found
    (its last line imports the package and FLOATER's solver) and runs the command."""
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", "scripts/gpu_device_setup.sh", sys.executable, "-c", "print('ran')"], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ran"
    assert "gpu_device_setup: torch " + torch.__version__ in done.stderr and "floater extension:" in done.stderr
