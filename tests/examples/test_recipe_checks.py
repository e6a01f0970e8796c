"""What the recipes' shell scripts check before fairseq runs (examples/recipe_checks.sh), with fairseq's
commands replaced by `true` where a script would reach them: no training here. Before, a missing data
folder ended in a traceback deep in fairseq after SAVE_DIR was made, a missing checkpoint to fine-tune
trained from scratch without a word (fairseq-train only logs "No existing checkpoint found"), and a
rerun of floater_warmstart.sh averaged the earlier run's epoch checkpoints, and a recipe stopped by a
signal left its fairseq-train running."""
import os
import signal
import subprocess
import time

import pytest

from util import REPO

EXAMPLES = REPO / "examples"


def script(path, *arguments, **env):
    return subprocess.run([str(EXAMPLES / path), *map(str, arguments)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CPU": "1", "FAIRSEQ_TRAIN": "true", "PYTHON": "true", **env})


@pytest.fixture
def made(tmp_path):
    """A data folder and a checkpoint file (never read: fairseq is `true`)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "model.pt").write_bytes(b"PK")
    return tmp_path / "bin", tmp_path / "model.pt"


def refused(done, message):
    return done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("case", ["glue", "race", "translation RESTORE", "floater_pretrain"])
def test_a_missing_checkpoint_to_fine_tune_is_refused(case, made, tmp_path):
    data, _ = made
    missing, save = tmp_path / "nope.pt", tmp_path / "save"
    done = {"glue": lambda: script("glue/finetune.sh", "RTE", data, missing, save),
            "race": lambda: script("race/finetune.sh", data, missing, save),
            "floater_pretrain": lambda: script("floater_pretrain/pretrain_dynamics.sh", missing, data, save),
            "translation RESTORE": lambda: script("translation/train.sh", data, save, RESTORE=str(missing))}[case]()
    assert refused(done, f"no checkpoint file {missing}"), done.stderr
    assert not save.exists()


@pytest.mark.parametrize("case", ["translation", "lm", "classification", "glue", "race", "lm preprocess",
                                  "floater_warmstart", "floater_pretrain"])
def test_a_missing_data_folder_is_refused_before_anything_is_made(case, made, tmp_path):
    _, checkpoint = made
    missing, save = tmp_path / "no-bin", tmp_path / "save"
    arguments = {"translation": ("translation/train.sh", missing, save), "lm": ("lm/train.sh", missing, save),
                 "classification": ("classification/train.sh", "IMDB", missing, save),
                 "glue": ("glue/finetune.sh", "RTE", missing, checkpoint, save),
                 "race": ("race/finetune.sh", missing, checkpoint, save),
                 "lm preprocess": ("lm/preprocess.sh", missing, save),
                 "floater_warmstart": ("translation/floater_warmstart.sh", missing, save),
                 "floater_pretrain": ("floater_pretrain/pretrain_dynamics.sh", checkpoint, missing, save)}[case]
    done = script(*arguments)
    assert refused(done, f"no folder {missing}"), done.stderr
    assert not save.exists()


def test_a_rerun_into_a_save_dir_says_that_fairseq_train_resumes(made, tmp_path):
    data, checkpoint = made
    save = tmp_path / "save"
    assert "resumes" not in script("translation/train.sh", data, save).stderr
    (save / "checkpoint_last.pt").write_bytes(b"PK")
    done = script("translation/train.sh", data, save)
    assert done.returncode == 0 and f"{save} holds checkpoint_last.pt: fairseq-train resumes from it" in done.stderr
    # a warm start (RESTORE) loads its checkpoint, not the save dir's: nothing to say
    assert "resumes" not in script("translation/train.sh", data, save, RESTORE=str(checkpoint)).stderr


def test_floater_warmstart_rerun_averages_only_its_own_epochs(made, tmp_path):
    data, checkpoint = made
    earlier = tmp_path / "work" / "floater" / "checkpoint6.pt"
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"PK")
    python = tmp_path / "python"  # the conversion writes its file, the half learning rate is printed
    python.write_text('#!/bin/bash\ncase "$1" in\n  *convert_transformer_checkpoint.py) printf PK > "$3" ;;\n'
                      '  -c) echo 0.00035 ;;\nesac\n')
    python.chmod(0o755)
    done = script("translation/floater_warmstart.sh", data, tmp_path / "work", SKIP_STOCK="1",
                  STOCK_CHECKPOINT=str(checkpoint), PYTHON=str(python))
    assert done.returncode == 0, done.stderr
    assert not earlier.exists()
    assert refused(script("translation/floater_warmstart.sh", data, tmp_path / "work", SKIP_STOCK="1",
                          STOCK_CHECKPOINT=str(tmp_path / "none.pt")), "no checkpoint file")


@pytest.mark.parametrize("case", ["DATA_BIN", "DATA_BIN through a link", "STOCK_CHECKPOINT"])
def test_floater_warmstart_refuses_an_input_in_the_folder_it_empties(case, made, tmp_path):
    """Before, `rm -rf WORK_DIR/floater` deleted a DATA_BIN or STOCK_CHECKPOINT kept there."""
    data, checkpoint = made
    work = tmp_path / "work"
    kept = work / "floater" / ("stock.pt" if case == "STOCK_CHECKPOINT" else "bin")
    kept.parent.mkdir(parents=True)
    if case == "STOCK_CHECKPOINT":
        kept.write_bytes(checkpoint.read_bytes())
        checkpoint = given = kept
    else:
        kept.mkdir()
        given = kept if case == "DATA_BIN" else tmp_path / "link"
        if case == "DATA_BIN through a link":
            given.symlink_to(kept)
        data = given
    python = tmp_path / "python"  # as in the test above: the conversion writes its file
    python.write_text('#!/bin/bash\ncase "$1" in\n  *convert_transformer_checkpoint.py) printf PK > "$3" ;;\n'
                      '  -c) echo 0.00035 ;;\nesac\n')
    python.chmod(0o755)
    done = script("translation/floater_warmstart.sh", data, work, SKIP_STOCK="1", STOCK_CHECKPOINT=str(checkpoint),
                  PYTHON=str(python))
    assert refused(done, f"{given} is or lies in {work / 'floater'}, which this recipe empties"), done.stderr
    assert kept.exists()


@pytest.mark.parametrize("case", ["WORK_DIR/data", "in WORK_DIR/data", "in WORK_DIR/data through a link"])
def test_run_s2l_refuses_a_raw_dir_in_the_folder_it_removes(case, tmp_path):
    """Before, `rm -rf WORK_DIR/data` deleted a RAW_DIR kept there, before anything read it."""
    work = tmp_path / "work"
    kept = work / "data" / ("" if case == "WORK_DIR/data" else "raw")
    kept.mkdir(parents=True)
    (kept / "train.en").write_text("a b\n")
    given = kept
    if case.endswith("link"):
        given = tmp_path / "raw"
        given.symlink_to(kept)
    done = script("extrapolation/run_s2l.sh", given, work)
    assert refused(done, f"{given} is or lies in {work / 'data'}, which this recipe removes"), done.stderr
    assert (kept / "train.en").exists()


def test_freeze_dynamics_takes_one_or_zero(made, tmp_path):
    """Before, FREEZE_DYNAMICS=yes trained the dynamics along (only the exact value 1 froze them)."""
    data, checkpoint = made
    done = script("floater_pretrain/finetune.sh", "race", data, checkpoint, tmp_path / "save", FREEZE_DYNAMICS="yes")
    assert refused(done, "FREEZE_DYNAMICS=yes: give 1 (frozen) or 0 (trained along)"), done.stderr


#: each recipe that runs fairseq-train, with its arguments (data folder, checkpoint, save dir) and its log
TRAINING = {
    "translation": lambda data, checkpoint, save: (("translation/train.sh", data, save), save / "train.log"),
    "lm": lambda data, checkpoint, save: (("lm/train.sh", data, save), save / "train.log"),
    "classification": lambda data, checkpoint, save: (("classification/train.sh", "IMDB", data, save),
                                                      save / "train.log"),
    "glue": lambda data, checkpoint, save: (("glue/finetune.sh", "RTE", data, checkpoint, save), save / "train.log"),
    "race": lambda data, checkpoint, save: (("race/finetune.sh", data, checkpoint, save), save / "train.log"),
    "floater_pretrain": lambda data, checkpoint, save: (("floater_pretrain/pretrain_dynamics.sh", checkpoint, data,
                                                         save), save / "dynamics" / "train.log"),
}


def fake_fairseq_train(tmp_path, body):
    path = tmp_path / "fairseq-train"
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("recipe, stop", [(recipe, "TERM") for recipe in sorted(TRAINING)]
                         + [("translation", "INT"), ("translation", "HUP")])  # one run_logged serves all
def test_a_recipe_stopped_by_a_signal_stops_its_fairseq_train(recipe, stop, made, tmp_path):
    """Before, fairseq-train ran on (it was `fairseq-train | tee`, which bash does not stop) after a `kill`
    of the recipe, or a scheduler's TERM to it; Ctrl-C worked only because it reaches the whole group."""
    data, checkpoint = made
    arguments, _ = TRAINING[recipe](data, checkpoint, tmp_path / "save")
    pid_file = tmp_path / "fairseq.pid"
    train = fake_fairseq_train(tmp_path, f'echo $$ > "{pid_file}"; echo started; exec sleep 60')
    recipe_process = subprocess.Popen(
        [str(EXAMPLES / arguments[0]), *map(str, arguments[1:])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "CPU": "1", "FAIRSEQ_TRAIN": train, "PYTHON": "true"}, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal, not ignored
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        train_pid = int(pid_file.read_text())
        recipe_process.send_signal(getattr(signal, f"SIG{stop}"))
        output, _ = recipe_process.communicate(timeout=20)
        assert recipe_process.returncode == 128 + signal.SIGTERM, output
        assert not os.path.exists(f"/proc/{train_pid}"), "fairseq-train still runs"
    finally:
        try:  # the recipe's session: whatever is left of it, the old `sleep 60` included
            os.killpg(recipe_process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        recipe_process.wait()


@pytest.mark.parametrize("recipe", sorted(TRAINING))
def test_a_recipe_ends_with_fairseq_trains_status_and_its_whole_log(recipe, made, tmp_path):
    data, checkpoint = made
    arguments, log = TRAINING[recipe](data, checkpoint, tmp_path / "save")
    log.parent.mkdir(parents=True)
    log.write_text("an earlier run\n")
    train = fake_fairseq_train(tmp_path, 'for i in $(seq 3000); do echo "line $i"; done; echo oops >&2; exit 3')
    done = script(*arguments, FAIRSEQ_TRAIN=train)
    assert done.returncode == 3, done.stderr
    assert log.read_text() == "an earlier run\n" + "".join(f"line {i}\n" for i in range(1, 3001)) + "oops\n"
    assert "line 3000\noops\n" in done.stdout


@pytest.mark.parametrize("case", ["glue", "race", "classification"])
@pytest.mark.parametrize("cpu", ["1", ""])
def test_the_fine_tuning_recipes_pass_the_device_options(case, cpu, made, tmp_path):
    """CPU=1 trains on the CPU; otherwise fp16 with the loss scaling of fairseq's RoBERTa fine-tuning recipes."""
    data, checkpoint = made
    save = tmp_path / "save"
    arguments = {"glue": ("glue/finetune.sh", "RTE", data, checkpoint, save),
                 "race": ("race/finetune.sh", data, checkpoint, save),
                 "classification": ("classification/train.sh", "IMDB", data, save)}[case]
    done = script(*arguments, CPU=cpu, FAIRSEQ_TRAIN="echo")
    assert done.returncode == 0, done.stderr
    fp16 = "--fp16 --fp16-init-scale 4 --threshold-loss-scale 1 --fp16-scale-window 128"
    assert (" --cpu" in done.stdout, fp16 in done.stdout) == ((True, False) if cpu else (False, True)), done.stdout


@pytest.mark.parametrize("path", sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.glob("*/*.sh")))
def test_help_prints_the_scripts_usage_and_does_nothing_else(path, tmp_path):
    """Before, `--help` was the first argument: a data folder that does not exist, or an OUT_DIR, where
    get_wmt14_en_de.sh's failed `mkdir -p --help/orig && cd` let it download WMT14 into the current folder."""
    done = subprocess.run([str(EXAMPLES / path), "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "FAIRSEQ_TRAIN": "false", "PYTHON": "false", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"examples/{path}" in done.stdout or path.split("/")[-1] in done.stdout, done.stdout
    assert not done.stdout.startswith(("#", "!")) and not list(tmp_path.iterdir())


def test_a_script_run_through_a_link_finds_its_checks(tmp_path):
    """(recipe_checks.sh is found beside the script's real path: get_wmt14_en_de.sh was self-contained before
    it sourced it, and a link to it elsewhere must still run.)"""
    (tmp_path / "get").symlink_to(EXAMPLES / "translation" / "get_wmt14_en_de.sh")
    done = subprocess.run(["./get", "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "OUT_DIR/{train,valid,test}.{en,de}" in done.stdout, done.stderr
