"""scripts/gpu_check.py, what only a GPU shows (FlexAttention's and the Triton kernel's calls and speed,
FLOATER's cost), run here as --device cpu: every check prints its table, the CUDA-only rows are skipped,
every other row passes (check t in Triton's interpreter, its own test for time);
a difference or an error becomes a FAIL row and exit status 1 while the other checks still run. (The
comparisons on CUDA are the test suite's: tests/devices.py.)"""
import math
import os
import subprocess
import sys

import pytest
import torch

from util import REPO, load_script

SCRIPT = REPO / "scripts" / "gpu_check.py"
CHECK_KEYS = "bet"
#: what the full CPU run covers (check t runs in the interpreter: `test_the_triton_check...`, smaller)
CPU_RUN_KEYS = "be"

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
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--only", ",".join(CPU_RUN_KEYS)],
                          capture_output=True, text=True, env=env, timeout=600)
    return done


def test_cpu_run_prints_every_table_and_passes_what_the_cpu_can_check(cpu_run):
    output = cpu_run.stdout
    assert "| torch | " + torch.__version__ in output and "| device | cpu |" in output
    found = tables(output)
    assert sorted(found) == list(CPU_RUN_KEYS), cpu_run.stderr[-3000:]
    for key in CPU_RUN_KEYS:
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


@pytest.fixture
def triton_interpreter(kernel_device):
    """Check t on the CPU: Triton's interpreter (`kernel_device` skips where it is off or Triton absent);
    with --device cuda the check runs compiled instead (scripts/gpu_check.py --device cuda --only t)."""
    if kernel_device.type != "cpu":
        pytest.skip("--device cuda: check t runs compiled there (scripts/gpu_check.py --device cuda --only t)")


def test_the_triton_check_passes_on_the_cpu_in_the_interpreter(capsys, monkeypatch, triton_interpreter):
    """Check t with gradients in Triton's interpreter (tests/devices.py turns it on without CUDA): T5, and
    ALiBi with a source row all padding, whose queries see no key (the row that found SDPA's backward
    of such rows wrong: `terms.with_masks_for_log_sum_exp`)."""
    gpu_check = load_script(SCRIPT)
    monkeypatch.setattr(gpu_check, "TRITON_FIRST", ["t5"])
    monkeypatch.setattr(gpu_check, "FLEX_MASKED", ["alibi"])
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "t"]) == 0
    rows = {label: (status, detail) for label, status, detail in tables(capsys.readouterr().out)["t"]}
    assert {label: status for label, (status, _) in rows.items()} == {
        "t5": "PASS", "alibi, a source row all padding": "PASS", "t5, bfloat16 model": "SKIP",
        "xl, float16 model": "SKIP"}


@pytest.mark.parametrize("check,module,first", [("b", "flex", "FLEX_FIRST"), ("t", "triton_attention", "TRITON_FIRST")])
def test_fused_logits_that_differ_fail_their_rows(capsys, monkeypatch, request, check, module, first):
    """Checks b and t compare FlexAttention and the Triton kernel with the reference path: an output
    moved by 1e-3 of its largest entry fails the rows that take the path, and the exit status is 1.
    (One encoding, to keep it short.)"""
    import importlib

    if check == "t":
        request.getfixturevalue("triton_interpreter")
    kernels = importlib.import_module(f"posenc_fairseq.kernels.{module}")
    gpu_check = load_script(SCRIPT)
    attend = kernels.attend

    def shifted(*args, **kwargs):
        out = attend(*args, **kwargs)
        return out + 1e-3 * out.abs().max()

    monkeypatch.setattr(kernels, "attend", shifted)
    monkeypatch.setattr(gpu_check, first, ["alibi"])
    monkeypatch.setattr(gpu_check, "FLEX_MASKED", ["alibi"])
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", check]) == 1
    rows = {label: (status, detail) for label, status, detail in tables(capsys.readouterr().out)[check]}
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
    assert exit_.value.code == 2 and "unknown checks ['a']; expected some of b, e, t; a, c, d, f, g are the test " \
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


def test_a_path_fails_where_it_is_further_from_float64_than_the_limit_and_the_reference_allow():
    """Checks b and t measure both paths from a float64 copy: a difference over the limit passes where the
    reference paths are within TRUTH_FACTOR of it (both round), and fails beyond; NaN fails."""
    gpu_check = load_script(SCRIPT)
    factor, limit = gpu_check.TRUTH_FACTOR, 1e-4

    def problems(error, reference):
        return gpu_check.Comparison({"logits": (1e-7, 1e-7), "w": (error, reference)}, done=1).problems(1, limit)

    assert problems(0.5 * limit, 0.0) == []
    assert problems(3 * limit, limit) == []  # as far as the reference paths, within the factor
    assert "exceeded: w" in problems(1.5 * factor * limit, limit)[0]
    assert "exceeded: w" in problems(2 * limit, 0.0)[0]
    assert "exceeded: w" in problems(math.nan, limit)[0]
    compared = gpu_check.Comparison({"logits": (1e-7, 2e-7), "a": (1e-6, 1e-6), "b": (3e-6, 1e-6)})
    assert (compared.logits, compared.reference_logits, compared.gradients, compared.worst_parameter) == (
        1e-7, 2e-7, 3e-6, "b")
