"""examples/translation/'s scripts on hand-made inputs, without training: average_checkpoints.py (its
options, models that cannot be averaged, what it keeps of the newest checkpoint), prepare.py (parallel
files line for line) and evaluate.py's reading of fairseq-generate's output (--nbest)."""
import errno
import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from util import REPO, load_script, run

TRANSLATION = REPO / "examples" / "translation"


@pytest.fixture(scope="module")
def averaging():
    return load_script(TRANSLATION / "average_checkpoints.py")


def save_checkpoint(path, model):
    """A checkpoint as fairseq saves one, holding `model` as its state dict."""
    torch.save({"model": model, "args": None, "cfg": None, "extra_state": {"epoch": 1}, "last_optimizer_state": None,
                "optimizer_history": [{"criterion_name": "c", "optimizer_name": "adam", "num_updates": 0,
                                       "lr_scheduler_state": {"best": 0.0}}]}, path)
    return path


def usage_error(capsys, main, *argv):
    """The stderr of main(argv), which must end in an error exit (2: usage, 1: SystemExit message)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    assert exit_info.value.code not in (0, None)
    return capsys.readouterr().err + str(exit_info.value.code)


@pytest.mark.parametrize("option", ["--num-epoch-checkpoints", "--num-update-checkpoints"])
@pytest.mark.parametrize("count", ["0", "-1"])
def test_average_checkpoints_refuses_a_count_below_one(averaging, tmp_path, capsys, option, count):
    for epoch in (1, 2):
        save_checkpoint(tmp_path / f"checkpoint{epoch}.pt", {"w": torch.tensor([float(epoch)])})
    err = usage_error(capsys, averaging.main, "--inputs", tmp_path, option, count, "--output", tmp_path / "avg.pt")
    assert f"argument {option}: must be at least 1, got {count}" in err
    assert not (tmp_path / "avg.pt").exists()


def test_average_checkpoints_refuses_models_with_other_entries_or_shapes(averaging, tmp_path, capsys):
    a = save_checkpoint(tmp_path / "a.pt", {"w": torch.tensor([2.0]), "extra": torch.tensor([4.0])})
    b = save_checkpoint(tmp_path / "b.pt", {"w": torch.tensor([4.0])})
    assert f"model entry extra is in {a} but not in {b}" in usage_error(
        capsys, averaging.main, "--inputs", a, b, "--output", tmp_path / "avg.pt")
    assert f"model entry extra is in {a} but not in {b}" in usage_error(  # the other way round too
        capsys, averaging.main, "--inputs", b, a, "--output", tmp_path / "avg.pt")
    c = save_checkpoint(tmp_path / "c.pt", {"w": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    d = save_checkpoint(tmp_path / "d.pt", {"w": torch.tensor([10.0])})  # would broadcast
    assert f"model entry w has shape (4,) in {c} but (1,) in {d}" in usage_error(
        capsys, averaging.main, "--inputs", c, d, "--output", tmp_path / "avg.pt")
    assert not (tmp_path / "avg.pt").exists()


def test_average_checkpoints_refuses_models_trained_with_other_encoding_options(averaging, tmp_path, capsys):
    """Their `trained_with` entries (equal lengths here: t5_max_distance 64 and 32) would average to no entry."""
    from posenc_fairseq.encodings import trained_with

    def entry(max_distance):
        return trained_with.entry("t5", {"t5_max_distance": trained_with.DefiningOption(max_distance, True)})

    a = save_checkpoint(tmp_path / "a.pt", {"w": torch.tensor([2.0]), "positional_encoding.trained_with": entry(64)})
    b = save_checkpoint(tmp_path / "b.pt", {"w": torch.tensor([4.0]), "positional_encoding.trained_with": entry(32)})
    assert f"model entry positional_encoding.trained_with differs between {a} and {b}" in usage_error(
        capsys, averaging.main, "--inputs", a, b, "--output", tmp_path / "avg.pt")
    assert not (tmp_path / "avg.pt").exists()
    averaging.main(["--inputs", str(a), str(a), "--output", str(tmp_path / "avg.pt")])
    model = torch.load(tmp_path / "avg.pt", weights_only=False)["model"]
    assert model["w"].tolist() == [2.0] and torch.equal(model["positional_encoding.trained_with"], entry(64))
    # a run across the package's upgrade: its earlier checkpoints have no entry; the later one's is kept
    older = save_checkpoint(tmp_path / "older.pt", {"w": torch.tensor([4.0])})
    for inputs in ([older, a], [a, older]):
        averaging.main(["--inputs", *map(str, inputs), "--output", str(tmp_path / "avg.pt")])
        model = torch.load(tmp_path / "avg.pt", weights_only=False)["model"]
        assert model["w"].tolist() == [3.0] and torch.equal(model["positional_encoding.trained_with"], entry(64))


def test_average_checkpoints_averages_floats_and_keeps_the_newest_integers(averaging, tmp_path, capsys):
    for epoch in (1, 2, 3):
        save_checkpoint(tmp_path / f"checkpoint{epoch}.pt",
                        {"w": torch.tensor([float(epoch)]), "half": torch.tensor([epoch], dtype=torch.float16),
                         "count": torch.tensor(10 * epoch)})
    averaging.main(["--inputs", str(tmp_path), "--num-epoch-checkpoints", "2", "--output", str(tmp_path / "avg.pt")])
    assert "checkpoint2.pt, checkpoint3.pt" in capsys.readouterr().out
    model = torch.load(tmp_path / "avg.pt", weights_only=False)["model"]
    assert model["w"].tolist() == [2.5] and model["w"].dtype == torch.float32
    assert model["half"].tolist() == [2.5] and model["half"].dtype == torch.float32  # as documented
    assert model["count"].item() == 30  # the newest one's, as documented (not the oldest's 20)
    # files given: the last one given is the newest
    averaging.main(["--inputs", str(tmp_path / "checkpoint3.pt"), str(tmp_path / "checkpoint1.pt"),
                    "--output", str(tmp_path / "avg.pt")])
    assert torch.load(tmp_path / "avg.pt", weights_only=False)["model"]["count"].item() == 10


def test_average_checkpoints_names_a_missing_input(averaging, tmp_path, capsys):
    err = usage_error(capsys, averaging.main, "--inputs", tmp_path / "missing.pt", "--output", tmp_path / "x.pt")
    assert "no checkpoint file" in err and "missing.pt" in err and "Traceback" not in err
    err = usage_error(capsys, averaging.main, "--inputs", tmp_path / "nowhere", "--num-epoch-checkpoints", "2",
                      "--output", tmp_path / "x.pt")
    assert "give one folder as --inputs" in err


def test_average_checkpoints_output_has_a_new_files_mode_or_the_replaced_ones(averaging, tmp_path, capsys):
    """Before, the output was left private (0600, its temporary file's mode), whatever the umask or the
    mode of the file it replaced; replacing an earlier output is said."""
    checkpoint = save_checkpoint(tmp_path / "checkpoint1.pt", {"w": torch.tensor([1.0])})
    out = tmp_path / "avg.pt"
    umask = os.umask(0o022)
    try:
        averaging.main(["--inputs", str(checkpoint), "--output", str(out)])
        assert stat.S_IMODE(out.stat().st_mode) == 0o644 and "replaced" not in capsys.readouterr().out
        out.chmod(0o664)
        averaging.main(["--inputs", str(checkpoint), "--output", str(out)])
        assert stat.S_IMODE(out.stat().st_mode) == 0o664
        assert f"replaced the earlier {out}" in capsys.readouterr().out
    finally:
        os.umask(umask)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["avg.pt", "checkpoint1.pt"]  # no temporaries


# ---------------------------------------------------------------- prepare.py
def write_pair(folder, split, source_lines, target_lines, src="en", tgt="de"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.{src}").write_text("".join(line + "\n" for line in source_lines), encoding="utf-8")
    (folder / f"{split}.{tgt}").write_text("".join(line + "\n" for line in target_lines), encoding="utf-8")


def test_prepare_refuses_parallel_files_of_different_lengths(tmp_path, capsys):
    prepare = load_script(TRANSLATION / "prepare.py")
    raw = tmp_path / "raw"
    write_pair(raw, "train", ["a b", "c d", "e f"], ["A B", "C D", "E F"])
    write_pair(raw, "valid", ["a b", "c d"], ["A B"])
    err = usage_error(capsys, prepare.main, raw, tmp_path / "out", "--src", "en", "--tgt", "de")
    assert f"{raw / 'valid.en'} has 2 lines but {raw / 'valid.de'} has 1" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_prepare_splits_lines_at_line_ends_only(tmp_path):
    """A U+2028 (or NEL, form feed) inside a sentence is not a line end for fairseq-preprocess: the
    encoded files keep one line per input line, so every pair stays a pair."""
    prepare = TRANSLATION / "prepare.py"
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]
    source = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(60)]
    source[5] += "\u2028tail"
    source[7] += "\x85more\x0cand more"
    target = [line.upper() for line in source]
    raw = tmp_path / "raw"
    for split, count in (("train", 60), ("test", 10)):
        write_pair(raw, split, source[:count], target[:count])
    run([sys.executable, prepare, raw, tmp_path / "out", "--vocab-size", "60", "--workers", "1", "--src", "en",
         "--tgt", "de"])
    for split, count in (("train", 60), ("test", 10)):
        for lang in ("en", "de"):
            encoded = (tmp_path / "out" / "spm" / f"{split}.{lang}").read_text(encoding="utf-8")
            assert encoded.count("\n") == count, (split, lang)
    # a second preparation into the same DEST (another vocabulary) is refused before it writes
    # anything: sentencepiece model and text would no longer match the binarised data
    before = {path: path.read_bytes() for path in (tmp_path / "out").rglob("*") if path.is_file()}
    done = subprocess.run([sys.executable, prepare, raw, tmp_path / "out", "--vocab-size", "50", "--workers", "1",
                           "--src", "en", "--tgt", "de"], capture_output=True, text=True)
    assert done.returncode == 2 and "holds an earlier preparation" in done.stderr
    assert "may be incomplete" not in done.stderr and (tmp_path / "out" / "prepare.done").is_file()
    assert {path: path.read_bytes() for path in (tmp_path / "out").rglob("*") if path.is_file()} == before


def test_prepare_stopped_by_sigterm_leaves_nothing_behind(tmp_path):
    """Before, SIGTERM (kill, a job scheduler) to the process group once sentencepiece had written its
    model left spm.model, spm/ and part of bin/, which the rerun refused as 'an earlier preparation'."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(500)]
    source = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(3000)]
    write_pair(tmp_path / "raw", "train", source, [line.upper() for line in source])
    dest = tmp_path / "out"
    # a process of its own: one the tests' fork server ran would not be in the process group signalled
    env = {name: value for name, value in os.environ.items() if name != "POSENC_TEST_FORK_SERVER"}
    process = subprocess.Popen([sys.executable, TRANSLATION / "prepare.py", tmp_path / "raw", dest, "--vocab-size", "100",
                                "--workers", "1"], start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(env, OMP_NUM_THREADS="1"))
    try:
        # once sentencepiece is trained: the text is encoded, then fairseq-preprocess starts (seconds
        # of imports before it can finish)
        while not (dest / "spm.model").exists() and process.poll() is None:
            time.sleep(0.02)
        time.sleep(0.3)
        os.killpg(process.pid, signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 1, (out, err)
    assert err.strip().splitlines()[-1] == f"interrupted; nothing kept in {dest}", err[-2000:]
    assert not dest.exists()


def test_prepare_names_a_killed_preparation_as_possibly_incomplete(tmp_path, capsys):
    """A preparation killed outright (SIGKILL) cannot clean up; it lacks the stamp written last."""
    prepare = load_script(TRANSLATION / "prepare.py")
    write_pair(tmp_path / "raw", "train", ["a b", "c d"], ["A B", "C D"])
    dest = tmp_path / "out"
    (dest / "bin").mkdir(parents=True)  # what a SIGKILL during fairseq-preprocess leaves
    (dest / "spm.model").write_text("model")
    (dest / "bin" / "dict.en.txt").write_text("partial")
    err = usage_error(capsys, prepare.main, tmp_path / "raw", dest, "--src", "en", "--tgt", "de")
    assert f"{dest} holds an earlier preparation (spm.model, bin) that may be incomplete (no prepare.done" in err
    assert sorted(path.name for path in dest.rglob("*")) == ["bin", "dict.en.txt", "spm.model"]


@pytest.mark.parametrize("existing_dest", [False, True])
def test_prepare_that_fails_midway_leaves_nothing_behind(tmp_path, monkeypatch, existing_dest):
    """Before, a failed fairseq-preprocess left spm.model, spm/ and part of bin/ in DEST (and a
    traceback), and the corrected rerun was refused as 'an earlier preparation'."""
    import subprocess as subprocess_module

    prepare = load_script(TRANSLATION / "prepare.py")
    raw = tmp_path / "raw"
    words = [f"w{i}" for i in range(30)]
    source = [" ".join(words[(i * 7 + j) % 30] for j in range(4)) for i in range(40)]
    write_pair(raw, "train", source, [line.upper() for line in source])
    dest = tmp_path / "out"
    if existing_dest:
        dest.mkdir()
        (dest / "README").write_text("the user's")

    def failing(command, check):
        (dest / "bin").mkdir()
        (dest / "bin" / "dict.en.txt").write_text("partial")
        raise subprocess_module.CalledProcessError(1, command)

    monkeypatch.setattr(prepare.subprocess, "run", failing)
    with pytest.raises(SystemExit, match="fairseq-preprocess failed .exit status 1.; nothing kept in"):
        prepare.main([str(raw), str(dest), "--vocab-size", "40", "--workers", "1", "--src", "en", "--tgt", "de"])
    assert sorted(path.name for path in dest.iterdir()) == ["README"] if existing_dest else not dest.exists()


@pytest.mark.parametrize("dest", ["a file", "under a file"])
def test_prepare_refuses_a_dest_that_cannot_be_a_folder_in_one_line(dest, tmp_path, capsys):
    """Before: FileExistsError / NotADirectoryError, a traceback."""
    prepare = load_script(TRANSLATION / "prepare.py")
    write_pair(tmp_path / "raw", "train", ["a b", "c d"], ["A B", "C D"])
    (tmp_path / "afile").write_text("mine")
    target = tmp_path / "afile" if dest == "a file" else tmp_path / "afile" / "out"
    err = usage_error(capsys, prepare.main, tmp_path / "raw", target, "--src", "en", "--tgt", "de")
    assert (f"{target} is not a folder" if dest == "a file" else f"cannot make {target}: Not a directory") in err, err
    assert "Traceback" not in err and (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("failure", ["disk full", "sentencepiece"])
def test_prepare_that_fails_on_the_way_says_why_in_one_line_and_keeps_nothing(failure, tmp_path, monkeypatch):
    """Before: OSError (a full disk while the text was encoded) or sentencepiece's RuntimeError (here: empty
    training files) as a traceback; what was written was removed all the same."""
    prepare = load_script(TRANSLATION / "prepare.py")
    raw = tmp_path / "raw"
    if failure == "sentencepiece":
        write_pair(raw, "train", [], [])
    else:
        source = [" ".join(f"w{(i * 7 + j) % 30}" for j in range(4)) for i in range(40)]
        write_pair(raw, "train", source, [line.upper() for line in source])
        written = []

        def full_disk(path, mode="r", *args, **kwargs):  # the encoded text's writes fail after a few lines
            handle = open(path, mode, *args, **kwargs)
            if "w" in mode:
                def write(text):
                    written.append(text)
                    if len(written) > 3:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    return type(handle).write(handle, text)
                handle.write = write
            return handle
        monkeypatch.setattr(prepare, "open", full_disk, raising=False)
    dest = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        prepare.main([str(raw), str(dest), "--vocab-size", "40", "--workers", "1", "--src", "en", "--tgt", "de"])
    expected = {"disk full": "error: No space left on device; nothing kept in",
                "sentencepiece": "error: sentencepiece training on train.en, train.de failed: "}[failure]
    assert expected in str(exit_info.value.code) and "\n" not in str(exit_info.value.code)
    assert not dest.exists()


def test_prepare_refuses_zero_workers(tmp_path, capsys):
    prepare = load_script(TRANSLATION / "prepare.py")
    err = usage_error(capsys, prepare.main, tmp_path, tmp_path / "out", "--workers", "0")
    assert "argument --workers: must be at least 1, got 0" in err


def test_prepare_refuses_a_split_it_would_drop(tmp_path, capsys):
    """Before, --splits train,vaild prepared train alone without a word."""
    prepare = load_script(TRANSLATION / "prepare.py")
    err = usage_error(capsys, prepare.main, tmp_path, tmp_path / "out", "--splits", "train,vaild")
    assert "unknown split vaild (train, valid, test)" in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- evaluate.py
def test_evaluate_scores_the_best_of_nbest_hypotheses():
    """fairseq-generate --nbest 2 prints each sentence's hypotheses best first (fairseq_cli/generate.py)."""
    evaluate = load_script(TRANSLATION / "evaluate.py")
    output = "\n".join([
        "S-0\tdas ist ein kleiner test", "T-0\tthis is a small test",
        "H-0\t-0.10\tthis is a small test", "D-0\t-0.10\tthis is a small test", "P-0\t-0.1 -0.1",
        "H-0\t-0.90\tbanana", "D-0\t-0.90\tbanana", "P-0\t-0.9",
        "S-1\tnoch ein satz hier", "T-1\tanother sentence here",
        "H-1\t-0.20\tanother sentence here", "D-1\t-0.20\tanother sentence here", "P-1\t-0.2",
        "H-1\t-0.95\tapple", "D-1\t-0.95\tapple", "P-1\t-0.9",
    ]) + "\n"
    sources, hypotheses, references = evaluate.parse(output)
    assert hypotheses == references == ["this is a small test", "another sentence here"]
    assert evaluate.bleu(hypotheses, references) == pytest.approx(100.0)


@pytest.mark.parametrize("bins,message", [("5,8x", "not a comma-separated list of lengths"),
                                          ("8,5", "lengths must be at least 0 and increasing"),
                                          ("-1,4", "lengths must be at least 0 and increasing")])
def test_evaluate_refuses_bad_bins_before_generating(bins, message, monkeypatch, capsys):
    """Before, --bins was read after the whole fairseq-generate run: 5,8x ended in a traceback with no
    --json written, and 8,5 gave overlapping bins."""
    evaluate = load_script(TRANSLATION / "evaluate.py")
    monkeypatch.setattr(evaluate, "generate", lambda *args, **kwargs: pytest.fail("generated"))
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["DATA", "CHECKPOINT", f"--bins={bins}"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert evaluate.lower_edges("0,5,9") == [0, 5, 9]
