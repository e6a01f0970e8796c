"""examples/race/evaluate.py's arithmetic: each accuracy, and the combined one, from the number of
questions answered right (fairseq-validate logs accuracies rounded to 0.1% only). The counting pass
itself (examples/checkpoint_eval.py) is tested in test_glue_scripts.py. preprocess_race.py: OUT_DIR
replaced only by a complete one, and never one that holds its input."""
import json

import pytest

from recipe_data import WORDS, write_race
from util import REPO, fail_at_call, load_script

PREPROCESS = REPO / "examples" / "race" / "preprocess_race.py"


def listing(folder):
    """{relative path: bytes (None for a folder)} of everything under `folder`."""
    return {str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
            for path in sorted(folder.rglob("*"))}


@pytest.fixture
def race(tmp_path):
    """RACE_DIR and a plain dictionary of its words: (RACE_DIR, dictionary)."""
    (tmp_path / "dicts").mkdir()
    (tmp_path / "dicts" / "dict.txt").write_text("".join(f"{word} 1\n" for word in WORDS))
    return write_race(tmp_path / "RACE"), tmp_path / "dicts" / "dict.txt"


def options(race, out):
    return [str(race[0]), str(out), "--bpe", "none", "--dict", str(race[1]), "--workers", "1"]


def test_preprocess_race_leaves_the_earlier_output_or_none_when_a_run_fails(race, tmp_path, monkeypatch):
    """Before, OUT_DIR was written in place: a failure left a half-built one, or part of a new one over
    the earlier one."""
    preprocess = load_script(PREPROCESS)
    out = tmp_path / "bin"
    preprocess.main(options(race, out))
    assert {"extracted", "input0", "input4", "label"} <= {path.name for path in out.iterdir()}
    other = write_race(tmp_path / "RACE2", seed=1)  # other data: what a run writes differs from the earlier output
    before = listing(tmp_path)
    calls = fail_at_call(monkeypatch, preprocess, "binarize", 2)
    for target in (out, tmp_path / "new-bin"):
        calls.clear()
        with pytest.raises(RuntimeError):
            preprocess.main(options((other, race[1]), target))
        assert listing(tmp_path) == before  # the earlier output as it was, no new or temporary folder left


@pytest.mark.parametrize("case", ["RACE_DIR", "the folder above RACE_DIR", "--dict's folder"])
def test_preprocess_race_refuses_an_out_dir_that_is_or_holds_an_input(case, race, tmp_path, capsys):
    out = {"RACE_DIR": race[0], "the folder above RACE_DIR": tmp_path, "--dict's folder": race[1].parent}[case]
    before = listing(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        load_script(PREPROCESS).main(options(race, out))
    assert exit_info.value.code == 2 and f"{out} would replace an input (" in capsys.readouterr().err
    assert listing(tmp_path) == before


def test_race_accuracies_come_from_counts(tmp_path, monkeypatch, capsys):
    evaluate = load_script(REPO / "examples" / "race" / "evaluate.py")
    counts = {"test": (1, 3, 3), "test1": (3, 7, 7)}  # middle 33.333...%, high 42.857...%: fairseq logs 33.3, 42.9
    monkeypatch.setattr(evaluate, "load_checkpoint", lambda checkpoint, data_bin, cpu: ("model", "cfg", "task"))
    monkeypatch.setattr(evaluate, "count_correct", lambda model, cfg, task, subset, batch_size, cpu: counts[subset])
    evaluate.main([str(tmp_path), "CHECKPOINT", "--cpu", "--json", str(tmp_path / "race.json")])
    out = capsys.readouterr().out
    assert "RACE middle accuracy = 33.33 (1 of 3 right)" in out
    assert "RACE high accuracy = 42.86 (3 of 7 right)" in out
    assert "RACE all accuracy = 40.00 (4 of 10 right)" in out  # not (3 * 33.3 + 7 * 42.9) / 10 = 40.02
    result = json.loads((tmp_path / "race.json").read_text())
    assert result["all"] == {"accuracy": 40.0, "correct": 4, "questions": 10}
