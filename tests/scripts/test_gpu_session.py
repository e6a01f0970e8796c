"""scripts/gpu_session.sh's plan, with `python3` and `nvidia-smi` replaced by stubs that record their calls:
every step's limit is cut so that the whole call ends inside the device's 600 s (a kill at 600 s would lose
the benchmark's results), and the records name the commit that gpu_carry.sh recorded, not the copy's own
git."""
import os
import re
import subprocess

import pytest

from util import REPO

STUB = """#!/bin/bash
echo "POSENC_SOURCE_COMMIT=${POSENC_SOURCE_COMMIT:-} $*" >> "$CALLS"
"""


@pytest.fixture
def session(tmp_path):
    """A stand-in for the device's copy: the real scripts/, a carried .gpu/source_commit, and stubs."""
    copy, bin_folder = tmp_path / "copy", tmp_path / "bin"
    (copy / "posenc_fairseq").mkdir(parents=True)
    (copy / "setup.py").write_text("")
    (copy / "scripts").symlink_to(REPO / "scripts")
    (copy / ".gpu").mkdir()
    (copy / ".gpu" / "source_commit").write_text("0123456789ab-dirty\n")
    bin_folder.mkdir()
    for name in ("python3", "nvidia-smi"):
        (bin_folder / name).write_text(STUB)
        (bin_folder / name).chmod(0o755)

    def run(elsewhere=None, **env):
        """The session from the copy's root, or run by its path from the folder `elsewhere`."""
        calls = tmp_path / "calls.txt"
        calls.unlink(missing_ok=True)
        command, folder = (["bash", "scripts/gpu_session.sh"], copy) if elsewhere is None else \
            (["bash", str(copy / "scripts" / "gpu_session.sh")], elsewhere)
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PATH": f"{bin_folder}:{os.environ['PATH']}", "CALLS": str(calls),
                                   "OUT": str(tmp_path / "out"), **env})
        assert done.returncode == 0, done.stderr
        return done.stdout, calls.read_text().splitlines()

    return run


def call_of(calls, script):
    found = [line for line in calls if script in line]
    assert len(found) <= 1
    return found[0] if found else None


def last_budget(line):
    return int(re.findall(r"--budget (\d+)", line)[-1])


def test_every_step_fits_in_the_device_call(session):
    printed, calls = session()  # the defaults: 150 s of tests, 230 s of benchmark, 90 s of check t
    assert "pytest exit code 0 (limit 150 s)" in printed
    assert last_budget(call_of(calls, "gpu_benchmark.py")) == 230
    assert last_budget(call_of(calls, "gpu_check.py")) == 90
    # the session's own limits: 150 + (230 + 60) + (90 + 30) = 560 s, inside SESSION_S = 570
    printed, calls = session(SESSION_S="400", GPU_BENCH_ARGS="--archs transformer_t5 --budget 999")
    assert "pytest exit code 0 (limit 100 s)" in printed  # 400 - 120 (check t) - 120 (benchmark's least) - 60
    # the stub's tests took no time: the benchmark gets what is left after check t's 120 s and its own 60 s of
    # start-up (400 - 120 - 60, less the seconds the stubs took); its --budget (the last one given wins) is
    # never GPU_BENCH_ARGS's
    benchmark = call_of(calls, "gpu_benchmark.py")
    assert "--archs transformer_t5" in benchmark and 215 <= last_budget(benchmark) <= 220
    printed, calls = session(SESSION_S="200", CHECK_T_S="0")
    assert "pytest skipped" in printed and call_of(calls, "-m pytest") is None
    assert 135 <= last_budget(call_of(calls, "gpu_benchmark.py")) <= 140 and call_of(calls, "gpu_check.py") is None


def test_the_records_name_the_carried_commit(session):
    _, calls = session(CHECK_T_S="0")
    assert call_of(calls, "gpu_benchmark.py").startswith("POSENC_SOURCE_COMMIT=0123456789ab-dirty ")


def test_run_from_another_folder_it_works_in_the_repository(session, tmp_path):
    """Before, its relative paths (docs/data/gpu_session, setup.py, .gpu) were taken in the current folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _, calls = session(elsewhere=elsewhere, CHECK_T_S="0", OUT="docs/data/gpu_session")
    assert call_of(calls, "gpu_benchmark.py").startswith("POSENC_SOURCE_COMMIT=0123456789ab-dirty ")
    assert (tmp_path / "copy" / "docs" / "data" / "gpu_session" / "gpu.txt").exists()
    assert not list(elsewhere.iterdir())
