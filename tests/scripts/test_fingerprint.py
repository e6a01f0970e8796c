"""scripts/fingerprint.py compare on hand-made dumps: bit for bit (-0.0 against +0.0, NaNs in other
places or with other payloads differ; NaNs in the same places with the same bits do not), and a
missing file named in one line. (`dump` itself runs every encoding: it is the refactoring check.)"""
import subprocess
import sys

import pytest
import torch

from util import REPO, load_script, sigterm_handler_of

FINGERPRINT = REPO / "scripts" / "fingerprint.py"


@pytest.fixture(scope="module")
def fingerprint():
    return load_script(FINGERPRINT)


def compared(fingerprint, capsys, tmp_path, a, b):
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    status = fingerprint.compare(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    return status, capsys.readouterr().out


def test_compare_is_bit_for_bit(fingerprint, capsys, tmp_path):
    nan = float("nan")
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a NaN with another payload
    a = {"zero": torch.tensor([0.0, 1.0]), "nan_places": torch.tensor([nan, 1.0, 2.0]),
         "nan_payload": torch.tensor([nan]), "same_nan": torch.tensor([nan, 3.0]), "apart": torch.tensor([1.0, 2.0]),
         "integers": torch.tensor([1, 2, 3])}
    b = {"zero": torch.tensor([-0.0, 1.0]), "nan_places": torch.tensor([1.0, nan, 2.0]), "nan_payload": other_nan,
         "same_nan": torch.tensor([nan, 3.0]), "apart": torch.tensor([1.0, 2.5]), "integers": torch.tensor([1, 2, 4])}
    status, out = compared(fingerprint, capsys, tmp_path, a, b)
    assert status == 1 and "5 differ" in out
    assert "DIFF zero: equal values, other bits" in out
    assert "DIFF nan_payload: equal values, other bits" in out
    assert "DIFF nan_places: NaN against a number in 2 places" in out  # not "max abs diff 0.000e+00"
    assert "DIFF apart: max abs diff 5.000e-01" in out
    assert "DIFF integers: 1 of 3 entries differ" in out
    assert "same_nan" not in out
    status, out = compared(fingerprint, capsys, tmp_path, {"same_nan": a["same_nan"]}, {"same_nan": b["same_nan"]})
    assert status == 0 and "0 differ" in out


def test_compare_names_a_missing_file(tmp_path):
    torch.save({"x": torch.zeros(1)}, tmp_path / "a.pt")
    done = subprocess.run([sys.executable, str(FINGERPRINT), "compare", str(tmp_path / "a.pt"),
                           str(tmp_path / "missing.pt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == f"error: no file {tmp_path / 'missing.pt'}"


@pytest.mark.parametrize("raised", ["PatchMissing", "RuntimeError"])
def test_a_case_that_raises_leaves_all_its_names_out(fingerprint, capsys, raised):
    """What a failing case put before it raised is dropped with it (a partial case would be compared
    name for name against another tree's full one); the other cases' names stay."""
    recorder = fingerprint.Recorder()
    recorder.case("ok", lambda: recorder.put("ok/out", torch.ones(2)))

    def failing():
        recorder.put("bad/out", torch.ones(3))
        recorder.put("bad/grad", [torch.ones(1), torch.zeros(1)])
        raise getattr(fingerprint, raised, RuntimeError)("backward failed")

    recorder.case("bad", failing)
    assert recorder.failed == ["bad"] and list(recorder.tensors) == ["ok/out"]
    assert ("SKIPPED bad" if raised == "PatchMissing" else "FAILED bad") in capsys.readouterr().err


# fingerprint.dump with its cases stubbed (one tensor recorded, and with "interrupt" an entry whose
# pickling raises KeyboardInterrupt: Ctrl-C during torch.save)
STUBBED_DUMP = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("fingerprint", sys.argv[1])
fingerprint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fingerprint)
class Interrupt:
    def __reduce__(self):
        raise KeyboardInterrupt
def case(rec, *args, **kwargs):
    print("a case ran", file=sys.stderr)
    rec.tensors["a/big"] = torch.ones(200000)
    if sys.argv[3] == "interrupt":
        rec.tensors["b/interrupt"] = Interrupt()
fingerprint.transformer_cases = fingerprint.lm_cases = fingerprint.roberta_cases = case
fingerprint.write_data = lambda root: root
sys.exit(fingerprint.dump(sys.argv[2], only=["t5"]))
"""


def stubbed_dump(out, how="whole"):
    return subprocess.run([sys.executable, "-c", STUBBED_DUMP, str(FINGERPRINT), str(out), how], capture_output=True,
                          text=True, timeout=300)


def test_an_interrupted_dump_leaves_the_earlier_one_whole(tmp_path):
    """Before, torch.save wrote straight into OUT: an interrupt left a truncated file in place of a complete
    earlier dump."""
    out = tmp_path / "fp.pt"
    torch.save({"x": torch.arange(3)}, out)
    done = stubbed_dump(out, "interrupt")
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr
    assert torch.equal(torch.load(out, weights_only=True)["x"], torch.arange(3))
    assert [path.name for path in tmp_path.iterdir()] == ["fp.pt"]  # no temporary file left
    done = stubbed_dump(out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(torch.load(out, weights_only=True)) == ["a/big"]


def test_an_out_that_cannot_be_written_is_refused_before_the_cases_run(tmp_path):
    """Before, OUT under a file or naming a folder was found by torch.save after every case had run,
    and ended in a traceback."""
    (tmp_path / "afile").write_text("")
    for out, message in ((tmp_path / "afile" / "fp.pt", f"{tmp_path / 'afile'} is not a folder this user may write in"),
                         (tmp_path, "is a folder: give a file name to write")):
        done = stubbed_dump(out)
        assert done.returncode == 1 and message in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
        assert "a case ran" not in done.stderr and "Traceback" not in done.stderr
    done = stubbed_dump(tmp_path / "new" / "folder" / "fp.pt")  # a folder it can make
    assert done.returncode == 0 and (tmp_path / "new" / "folder" / "fp.pt").is_file(), done.stderr[-2000:]


def test_sigterm_ends_a_dump_as_ctrl_c_does():
    """Before, SIGTERM (kill, a job scheduler's stop) ended a dump at once, past the removal of its
    temporary files that an interrupt runs."""
    assert sigterm_handler_of(FINGERPRINT) == "posenc_fairseq.cli_signals"
