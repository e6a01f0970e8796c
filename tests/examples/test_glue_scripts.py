"""examples/glue/'s scripts on tiny GLUE files (tests/examples/recipe_data.py), without training:
preprocess_glue.py (a wrong GLUE_DIR, the input tree only read, an earlier output replaced only by a
complete one) and evaluate.py's prediction pass (dev examples longer than the model's positions)."""
import argparse

import pytest
import torch

from recipe_data import WORDS, write_glue
from util import REPO, fail_at_call, load_script

GLUE = REPO / "examples" / "glue"


def listing(folder):
    """{relative path: bytes (None for a folder)} of everything under `folder`."""
    return {str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
            for path in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def preprocess():
    return load_script(GLUE / "preprocess_glue.py")


@pytest.fixture(scope="module")
def mrpc(tmp_path_factory, preprocess):
    """GLUE_DIR with MRPC, a plain dictionary of its words, and MRPC binarised by preprocess_glue.py."""
    root = tmp_path_factory.mktemp("glue")
    (root / "dict.txt").write_text("".join(f"{word} 1\n" for word in WORDS))
    write_glue(root / "glue_data", "MRPC")
    preprocess.main([str(root / "glue_data"), "MRPC", str(root / "MRPC-bin"), "--bpe", "none",
                     "--dict", str(root / "dict.txt"), "--workers", "1"])
    return argparse.Namespace(root=root, glue=root / "glue_data", bin=root / "MRPC-bin", dict=root / "dict.txt")


def options(mrpc, glue_dir, out):
    return [str(glue_dir), "MRPC", str(out), "--bpe", "none", "--dict", str(mrpc.dict), "--workers", "1"]


def test_preprocess_glue_leaves_the_input_tree_alone_and_nothing_beside_its_output(mrpc, preprocess, tmp_path):
    assert sorted(path.name for path in (mrpc.glue / "MRPC").iterdir()) == ["dev.tsv", "test.tsv", "train.tsv"]
    assert sorted(path.name for path in mrpc.root.iterdir()) == ["MRPC-bin", "dict.txt", "glue_data"]
    assert {"input0", "input1", "label"} <= {path.name for path in mrpc.bin.iterdir()}
    # a folder of the user's own called `processed` in GLUE_DIR/TASK is not touched
    glue = tmp_path / "glue_data"
    write_glue(glue, "MRPC")
    (glue / "MRPC" / "processed").mkdir()
    (glue / "MRPC" / "processed" / "my_notes.txt").write_text("keep me")
    before = listing(glue)
    preprocess.main(options(mrpc, glue, tmp_path / "MRPC-bin"))
    assert listing(glue) == before


def test_preprocess_glue_refuses_a_missing_task_folder_before_touching_anything(mrpc, preprocess, tmp_path, capsys):
    out = tmp_path / "MRPC-bin"
    preprocess.main(options(mrpc, mrpc.glue, out))
    before = listing(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(options(mrpc, tmp_path / "glue_dta", out))
    assert exit_info.value.code == 2
    assert f"no folder {tmp_path / 'glue_dta' / 'MRPC'}" in capsys.readouterr().err
    assert listing(tmp_path) == before  # the earlier output whole, nothing created in the wrong GLUE_DIR
    (tmp_path / "glue_dta" / "MRPC").mkdir(parents=True)
    with pytest.raises(SystemExit):
        preprocess.main(options(mrpc, tmp_path / "glue_dta", out))
    assert "no train.tsv in" in capsys.readouterr().err


def test_preprocess_glue_keeps_the_earlier_output_when_a_run_fails(mrpc, preprocess, tmp_path, monkeypatch):
    out = tmp_path / "MRPC-bin"
    preprocess.main(options(mrpc, mrpc.glue, out))
    before = listing(tmp_path)
    fail_at_call(monkeypatch, preprocess, "binarize", 2)
    with pytest.raises(RuntimeError):
        preprocess.main(options(mrpc, mrpc.glue, out))
    assert listing(tmp_path) == before  # the earlier output as it was, no temporary folder left


@pytest.mark.parametrize("case", ["GLUE_DIR/TASK", "GLUE_DIR", "--dict's folder", "--dict through a link",
                                  "--bpe-dir's folder"])
def test_preprocess_glue_refuses_an_out_dir_that_is_or_holds_an_input(case, mrpc, preprocess, tmp_path, capsys):
    """Before, the input went with the earlier OUT_DIR that the new one replaced, and the run said it
    had binarised the task."""
    glue = write_glue(tmp_path / "glue_data", "MRPC")
    dictionary = tmp_path / "dicts" / "dict.txt"
    dictionary.parent.mkdir()
    dictionary.write_bytes(mrpc.dict.read_bytes())
    argv = options(mrpc, glue, None)
    if case == "--dict through a link":  # the link elsewhere, the file in OUT_DIR
        (tmp_path / "link.txt").symlink_to(dictionary)
        argv[argv.index("--dict") + 1] = str(tmp_path / "link.txt")
    else:
        argv[argv.index("--dict") + 1] = str(dictionary)
    if case == "--bpe-dir's folder":  # GPT-2's files there already: nothing to download
        bpe = tmp_path / "work" / "gpt2_bpe"
        bpe.mkdir(parents=True)
        for name in ("encoder.json", "vocab.bpe", "dict.txt"):
            (bpe / name).write_text("{}")
        argv[argv.index("--bpe") + 1] = "gpt2"
        argv += ["--bpe-dir", str(bpe)]
    out = {"GLUE_DIR/TASK": glue / "MRPC", "GLUE_DIR": glue, "--dict's folder": dictionary.parent,
           "--dict through a link": dictionary.parent, "--bpe-dir's folder": tmp_path / "work"}[case]
    argv[2] = str(out)
    before = listing(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{out} would replace an input (" in err and "give another output folder" in err, err
    assert listing(tmp_path) == before


def test_preprocess_glue_stopped_by_sigterm_leaves_no_temporary_folder(mrpc, tmp_path):
    """Before, SIGTERM ended the run at once: the folder it builds in stayed beside OUT_DIR."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "MRPC-bin"
    # the script run as a command (its __main__), with fairseq-preprocess taking long: stopped while it builds
    code = ("import runpy, sys, time, fairseq_cli.preprocess as fairseq_preprocess\n"
            "fairseq_preprocess.main = lambda args: time.sleep(120)\n"
            f"sys.argv[0] = {str(GLUE / 'preprocess_glue.py')!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    # a process of its own (not one of the tests' fork server's), whose Python sets its handlers
    env = {name: value for name, value in os.environ.items() if name != "POSENC_TEST_FORK_SERVER"}
    process = subprocess.Popen([sys.executable, "-c", code, *options(mrpc, mrpc.glue, out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(env, OMP_NUM_THREADS="1"))
    try:
        while not list(tmp_path.glob(".MRPC-bin.*/processed/train.label")) and process.poll() is None:
            time.sleep(0.02)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert list(tmp_path.iterdir()) == [], err[-2000:]
    assert process.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]  # (what Ctrl-C ends in)


# ---------------------------------------------------------------- evaluate.py's prediction pass
class PredictsFirstClass(torch.nn.Module):
    """A stand-in classifier with the model's interface: always the first class."""

    classification_heads = {"sentence_classification_head": None}

    def __init__(self, positions):
        super().__init__()
        self.positions = positions

    def max_positions(self):
        return self.positions

    def get_targets(self, sample, net_output):
        return sample["target"]

    def forward(self, src_tokens, src_lengths=None, features_only=True, classification_head_name=None):
        return torch.tensor([[1.0, 0.0]]).repeat(src_tokens.size(0), 1), None


def sentence_prediction(data_bin, max_positions):
    """fairseq's sentence_prediction task and criterion on `data_bin`, as fine-tuning sets them up."""
    from fairseq import options as fairseq_options
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = fairseq_options.get_training_parser()
    args = fairseq_options.parse_args_and_arch(parser, [
        str(data_bin), "--task", "sentence_prediction", "--num-classes", "2", "--max-positions", str(max_positions),
        "--arch", "roberta_base", "--cpu", "--criterion", "sentence_prediction"])
    cfg = convert_namespace_to_omegaconf(args)
    return cfg, tasks.setup_task(cfg.task)


def dev_rows(mrpc):
    """(label, words of sentence 1, words of sentence 2) of MRPC's dev.tsv (header dropped)."""
    rows = [line.split("\t") for line in (mrpc.glue / "MRPC" / "dev.tsv").read_text().splitlines()[1:]]
    return [(row[0], len(row[3].split()), len(row[4].split())) for row in rows]


def test_glue_predict_refuses_or_counts_examples_longer_than_the_model(mrpc, capsys):
    evaluate = load_script(GLUE / "evaluate.py")
    _, task = sentence_prediction(mrpc.bin, 16)
    rows = dev_rows(mrpc)
    too_long = sum(words1 + 1 + words2 + 1 > 16 for _, words1, words2 in rows)  # each sentence ends in </s>
    assert 0 < too_long < len(rows)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.predict(PredictsFirstClass(16), task, "valid", "h", False, True, 32)
    assert f"{too_long} of {len(rows)} examples of subset valid are longer than the model's max positions (16" in str(
        exit_info.value.code)
    predictions, targets, examples = evaluate.predict(PredictsFirstClass(16), task, "valid", "h", False, True, 32,
                                                      skip_too_long=True)
    assert len(predictions) == len(targets) == len(rows) - too_long and examples == len(rows)
    evaluate.print_scored("MRPC", "dev", targets, examples)
    assert f"MRPC dev: scored {len(rows) - too_long} of {len(rows)}" in capsys.readouterr().out


def test_checkpoint_eval_counts_right_answers_with_the_criterion(mrpc):
    checkpoint_eval = load_script(REPO / "examples" / "checkpoint_eval.py")
    cfg, task = sentence_prediction(mrpc.bin, 512)
    task.load_dataset("valid")
    first_label = task.label_dictionary[task.label_dictionary.nspecial]  # what class 0 stands for
    rows = dev_rows(mrpc)
    right = sum(label == first_label for label, _, _ in rows)
    assert 0 < right < len(rows)
    counts = checkpoint_eval.count_correct(PredictsFirstClass(512), cfg, task, "valid", 5, True)
    assert counts == (right, len(rows), len(rows))  # (right, scored, in the subset), over batches of 5
