"""What the example scripts write and read, checked before their work: an output never replaces an
input (a checkpoint, a file of the data folder, a result read), a text file is not taken for a
checkpoint, an output that cannot be written is one error line, and a report with nothing to report
fails instead of writing an empty table. On the code before, evaluate.py --json CHECKPOINT replaced
the checkpoint with JSON after the whole generation run."""
import json

import pytest
import torch

from util import REPO, load_script

EXAMPLES = REPO / "examples"


def refused(capsys, main, *argv):
    """The stderr (and exit message) of main(argv), which must end in an error exit."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    assert exit_info.value.code not in (0, None)
    return capsys.readouterr().err + str(exit_info.value.code)


@pytest.fixture
def inputs(tmp_path):
    """A data folder with a dictionary and a checkpoint file (torch.save's format), and their bytes."""
    data = tmp_path / "data-bin"
    data.mkdir()
    (data / "dict.en.txt").write_text("a 1\n")
    checkpoint = tmp_path / "checkpoint_best.pt"
    torch.save({"model": {}}, checkpoint)
    return data, checkpoint, {path: path.read_bytes() for path in (data / "dict.en.txt", checkpoint)}


def unchanged(originals):
    return all(path.read_bytes() == content for path, content in originals.items())


def no_work(module, name):
    """`module.name` replaced by a function that fails the test: the refusal must come before it."""
    def ran(*args, **kwargs):
        pytest.fail(f"{name} ran before the refusal")
    return ran


EVALUATIONS = {  # script, the step a refusal must come before, its arguments before DATA CHECKPOINT
    "translation": ("translation/evaluate.py", "generate", []),
    "lm": ("lm/evaluate.py", "eval_lm", []),
    "glue": ("glue/evaluate.py", "load_checkpoint", ["RTE"]),
    "classification": ("classification/evaluate.py", "glue_evaluate.load_checkpoint", ["IMDB"]),  # glue's loading
    "race": ("race/evaluate.py", "load_checkpoint", []),
}


@pytest.mark.parametrize("script", sorted(EVALUATIONS))
@pytest.mark.parametrize("target", ["checkpoint", "data file", "folder", "under a file"])
def test_evaluate_json_that_would_replace_an_input_or_cannot_be_written_is_refused_first(
        script, target, inputs, tmp_path, monkeypatch, capsys):
    path, step, leading = EVALUATIONS[script]
    evaluate = load_script(EXAMPLES / path)
    *owners, name = step.split(".")
    owner = evaluate
    for attribute in owners:
        owner = getattr(owner, attribute)
    monkeypatch.setattr(owner, name, no_work(owner, name))
    data, checkpoint, originals = inputs
    output = {"checkpoint": checkpoint, "data file": data / "dict.en.txt", "folder": tmp_path,
              "under a file": checkpoint / "scores.json"}[target]
    err = refused(capsys, evaluate.main, *leading, data, checkpoint, "--json", output)
    expected = {"checkpoint": "would replace an input", "data file": "would replace an input",
                "folder": "is a folder", "under a file": "is not a folder this user may write in"}[target]
    assert expected in err and "Traceback" not in err
    assert unchanged(originals)


def test_translation_evaluate_save_output_is_checked_too(inputs, monkeypatch, capsys):
    evaluate = load_script(EXAMPLES / "translation" / "evaluate.py")
    monkeypatch.setattr(evaluate, "generate", no_work(evaluate, "generate"))
    data, checkpoint, originals = inputs
    err = refused(capsys, evaluate.main, data, checkpoint, "--save-output", data / "dict.en.txt")
    assert "would replace an input" in err
    err = refused(capsys, evaluate.main, data, checkpoint, "--save-output", data.parent / "out.txt",
                  "--json", data.parent / "out.txt")
    assert "--json and --save-output are both" in err
    assert unchanged(originals)


@pytest.mark.parametrize("script", ["translation", "lm"])
@pytest.mark.parametrize("given", ["text file", "missing data"])
def test_evaluate_refuses_what_is_no_checkpoint_or_no_data_before_running_fairseq(script, given, inputs,
                                                                                   monkeypatch, capsys):
    """Before, both ran fairseq's command on them and relayed its traceback."""
    path, step, _ = EVALUATIONS[script]
    evaluate = load_script(EXAMPLES / path)
    monkeypatch.setattr(evaluate, step, no_work(evaluate, step))
    data, checkpoint, _ = inputs
    if given == "text file":
        checkpoint.write_text("iteration 5 loss 3.2\n")
        assert "is not a fairseq checkpoint" in refused(capsys, evaluate.main, data, checkpoint)
    else:
        assert "no folder" in refused(capsys, evaluate.main, data.parent / "missing", checkpoint)


def test_translation_evaluate_writes_its_outputs_whole_into_a_new_folder(inputs, monkeypatch):
    evaluate = load_script(EXAMPLES / "translation" / "evaluate.py")
    output = "S-0\tdas ist ein kleiner test\nT-0\tthis is a small test\nH-0\t-0.1\tthis is a small test\n"
    monkeypatch.setattr(evaluate, "generate", lambda *args, **kwargs: (output, ""))
    data, checkpoint, originals = inputs
    folder = data.parent / "results" / "t5"
    evaluate.main([str(data), str(checkpoint), "--json", str(folder / "bleu.json"),
                   "--save-output", str(folder / "generate.txt")])
    assert json.loads((folder / "bleu.json").read_text())["bleu"] == pytest.approx(100.0)
    assert (folder / "generate.txt").read_text() == output
    assert sorted(path.name for path in folder.iterdir()) == ["bleu.json", "generate.txt"]  # no temporaries
    assert unchanged(originals)


def test_checkpoint_eval_names_a_text_file_given_as_checkpoint(inputs, capsys):
    """Before: KeyError: 105 from torch.load (a file starting with 'i')."""
    checkpoint_eval = load_script(EXAMPLES / "checkpoint_eval.py")
    data, checkpoint, _ = inputs
    checkpoint.write_text("iteration 5 loss 3.2\n")
    err = refused(capsys, checkpoint_eval.main, data, checkpoint, "--cpu")
    assert "is not a fairseq checkpoint" in err and "KeyError" not in err


def test_glue_evaluate_names_a_checkpoint_without_the_classification_head():
    """Before: TypeError about classification_head_name, from the forward of a translation model."""
    import argparse

    glue = load_script(EXAMPLES / "glue" / "evaluate.py")
    cfg = argparse.Namespace(criterion=argparse.Namespace(), task=argparse.Namespace(_name="translation"))
    with pytest.raises(SystemExit) as exit_info:
        glue.classification_head(torch.nn.Linear(1, 1), cfg, "translation.pt")
    assert "has no classification head 'sentence_classification_head'" in str(exit_info.value.code)
    model = torch.nn.Module()
    model.classification_heads = torch.nn.ModuleDict({"sentence_classification_head": torch.nn.Linear(1, 1)})
    assert glue.classification_head(model, cfg, "glue.pt") == "sentence_classification_head"


# ---------------------------------------------------------------- reports
def test_reports_refuse_to_write_over_a_result_they_read(tmp_path, capsys):
    lm_result = tmp_path / "ppl_t5.json"
    lm_result.write_text(json.dumps({"ppl": {"150": 30.0}, "best": 30.0}))
    lm_report = load_script(EXAMPLES / "lm" / "report.py")
    assert "would replace an input" in refused(capsys, lm_report.main, lm_result, "--out", lm_result)
    assert json.loads(lm_result.read_text())["best"] == 30.0

    classification_result = tmp_path / "work" / "xl" / "IMDB.json"
    classification_result.parent.mkdir(parents=True)
    classification_result.write_text(json.dumps({"value": 88.0, "metric": "acc", "as_in_table": True}))
    classification_report = load_script(EXAMPLES / "classification" / "report.py")
    err = refused(capsys, classification_report.main, tmp_path / "work", "--out", classification_result)
    assert "would replace an input" in err and json.loads(classification_result.read_text())["value"] == 88.0

    extrapolation_report = load_script(EXAMPLES / "extrapolation" / "report.py")
    markdown = tmp_path / "s2l.md"  # a result named .md, and the prefix that would write s2l.md
    markdown.write_text("{}")
    assert "would replace an input" in refused(capsys, extrapolation_report.main, markdown, "--out", tmp_path / "s2l")
    assert markdown.read_text() == "{}"


def test_classification_report_with_nothing_to_report_fails(tmp_path, capsys):
    """Before: a header-only table and exit 0 for a missing folder or a misspelt encoding."""
    report = load_script(EXAMPLES / "classification" / "report.py")
    out = tmp_path / "table1.md"
    assert "no folder" in refused(capsys, report.main, tmp_path / "nope", "--out", out)
    (tmp_path / "work" / "xl").mkdir(parents=True)
    assert "no results in" in refused(capsys, report.main, tmp_path / "work", "--out", out)
    (tmp_path / "work" / "xl" / "IMDB.json").write_text(json.dumps({"value": 88.0}))
    assert "no results of xll" in refused(capsys, report.main, tmp_path / "work", "--out", out, "--encodings", "xll")
    (tmp_path / "work" / "xl" / "SNLI.json").write_text('"a string"')
    err = refused(capsys, report.main, tmp_path / "work", "--out", out)
    assert "SNLI.json is not a result of evaluate.py --json" in err and "Traceback" not in err
    assert not out.exists()
    (tmp_path / "work" / "xl" / "SNLI.json").unlink()
    assert report.main([str(tmp_path / "work"), "--out", str(out)]) == 0
    assert "88.00" in out.read_text()


def test_a_missing_result_is_named_missing_not_a_second_of_its_name(tmp_path, capsys):
    (tmp_path / "bleu_t5.json").write_text(json.dumps({"bleu": 20.0, "bins": []}))
    report = load_script(EXAMPLES / "extrapolation" / "report.py")
    err = refused(capsys, report.main, tmp_path / "bleu_t5.json", tmp_path / "t5.json", "--out", tmp_path / "s2l")
    assert "no file" in err and "two results named" not in err


# ---------------------------------------------------------------- average_checkpoints.py
def test_average_checkpoints_refuses_an_output_that_is_an_input_or_a_text_input(inputs, tmp_path, capsys):
    """Before: --output equal to an input replaced that checkpoint with the average."""
    averaging = load_script(EXAMPLES / "translation" / "average_checkpoints.py")
    _, checkpoint, originals = inputs
    other = tmp_path / "checkpoint2.pt"
    torch.save({"model": {}}, other)
    err = refused(capsys, averaging.main, "--inputs", checkpoint, other, "--output", checkpoint)
    assert "would replace an input" in err and unchanged(originals)
    notes = tmp_path / "notes.txt"
    notes.write_text("iteration 5\n")
    err = refused(capsys, averaging.main, "--inputs", checkpoint, notes, "--output", tmp_path / "avg.pt")
    assert "notes.txt is not a fairseq checkpoint" in err and "KeyError" not in err


def test_write_text_atomic_gives_a_new_files_mode_or_keeps_the_replaced_ones(tmp_path):
    """Before, every file it wrote was private (0600, its temporary file's mode), whatever the umask or
    the mode of the file it replaced."""
    import os
    import stat

    helpers = load_script(EXAMPLES / "script_helpers.py")
    path = tmp_path / "table.md"
    umask = os.umask(0o027)
    try:
        helpers.write_text_atomic(path, "one\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "one\n"
        path.chmod(0o604)
        helpers.write_text_atomic(path, "two\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o604 and path.read_text() == "two\n"
    finally:
        os.umask(umask)
    assert [entry.name for entry in tmp_path.iterdir()] == ["table.md"]
