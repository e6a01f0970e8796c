"""examples/lm/'s scripts without a model: evaluate.py's options (refused before fairseq-eval-lm runs)
and report.py on result files with different memories."""
import json

import pytest
import torch

from util import REPO, load_script

LM = REPO / "examples" / "lm"


@pytest.mark.parametrize("options,message", [
    (["--memory", "-50"], "argument --memory: must be at least 0, got -50"),
    (["--memory", "150", "-1"], "argument --memory: must be at least 0, got -1"),
    (["--block", "0"], "argument --block: must be at least 1, got 0"),
    (["--block", "-10"], "argument --block: must be at least 1, got -10"),
])
def test_evaluate_refuses_a_negative_memory_or_an_empty_block(options, message, monkeypatch, capsys):
    evaluate = load_script(LM / "evaluate.py")
    ran = []
    monkeypatch.setattr(evaluate.subprocess, "run", lambda *args, **kwargs: ran.append(args))
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["DATA", "CHECKPOINT", *options])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not ran  # fairseq-eval-lm never started


def test_report_matches_columns_by_memory(tmp_path, capsys):
    (tmp_path / "ppl_t5.json").write_text(json.dumps({"ppl": {"150": 30.0, "640": 29.0}, "best": 29.0}))
    (tmp_path / "ppl_xl.json").write_text(json.dumps({"ppl": {"150": 28.0}, "best": 28.0}))
    (tmp_path / "ppl_toy.json").write_text(json.dumps({"ppl": {"640": 27.0, "16": 40.0}, "best": 27.0}))
    report = load_script(LM / "report.py")
    assert report.main([str(tmp_path / name) for name in ("ppl_t5.json", "ppl_xl.json", "ppl_toy.json")]
                       + ["--out", str(tmp_path / "t3.md")]) == 0
    lines = (tmp_path / "t3.md").read_text().splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[4:] == ["ours M=16", "ours M=150", "ours M=640", "ours best"]
    rows = {cells[0]: cells[4:] for cells in ([cell.strip() for cell in line.strip("|").split("|")]
                                              for line in lines[2:])}
    assert rows == {"t5": ["–", "30.00", "29.00", "29.00"], "xl": ["–", "28.00", "–", "28.00"],
                    "toy": ["40.00", "–", "27.00", "27.00"]}
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path / "ppl_missing.json"), "--out", str(tmp_path / "x.md")])
    assert exit_info.value.code == 2 and "no file" in capsys.readouterr().err


def test_evaluate_runs_the_fairseq_eval_lm_beside_its_python(monkeypatch, tmp_path):
    """A venv's python run without the venv on PATH still finds fairseq's commands."""
    import sys
    from pathlib import Path

    evaluate = load_script(LM / "evaluate.py")
    ran = []
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    monkeypatch.delenv("FAIRSEQ_EVAL_LM", raising=False)

    def recorded(command, **kwargs):
        ran.append(command)
        raise SystemExit(0)

    monkeypatch.setattr(evaluate.subprocess, "run", recorded)
    (tmp_path / "data").mkdir()
    torch.save({}, tmp_path / "checkpoint.pt")
    with pytest.raises(SystemExit):
        evaluate.main([str(tmp_path / "data"), str(tmp_path / "checkpoint.pt"), "--memory", "4", "--block", "4"])
    assert ran[0][0] == str(Path(sys.executable).parent / "fairseq-eval-lm")
