"""examples/race/evaluate.py's arithmetic: each accuracy, and the combined one, from the number of
questions answered right (fairseq-validate logs accuracies rounded to 0.1% only). The counting pass
itself (examples/checkpoint_eval.py) is tested in test_glue_scripts.py."""
import json

from util import REPO, load_script


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
