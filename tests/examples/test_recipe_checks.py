"""What the recipes' shell scripts check before fairseq runs (examples/recipe_checks.sh), with fairseq's
commands replaced by `true` where a script would reach them: no training here. Before, a missing data
folder ended in a traceback deep in fairseq after SAVE_DIR was made, a missing checkpoint to fine-tune
trained from scratch without a word (fairseq-train only logs "No existing checkpoint found"), and a
rerun of floater_warmstart.sh averaged the earlier run's epoch checkpoints."""
import os
import subprocess

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


@pytest.mark.parametrize("case", ["glue", "race", "translation RESTORE"])
def test_a_missing_checkpoint_to_fine_tune_is_refused(case, made, tmp_path):
    data, _ = made
    missing, save = tmp_path / "nope.pt", tmp_path / "save"
    done = {"glue": lambda: script("glue/finetune.sh", "RTE", data, missing, save),
            "race": lambda: script("race/finetune.sh", data, missing, save),
            "translation RESTORE": lambda: script("translation/train.sh", data, save, RESTORE=str(missing))}[case]()
    assert refused(done, f"no checkpoint file {missing}"), done.stderr
    assert not save.exists()


@pytest.mark.parametrize("case", ["translation", "lm", "classification", "glue", "race", "lm preprocess",
                                  "floater_warmstart"])
def test_a_missing_data_folder_is_refused_before_anything_is_made(case, made, tmp_path):
    _, checkpoint = made
    missing, save = tmp_path / "no-bin", tmp_path / "save"
    arguments = {"translation": ("translation/train.sh", missing, save), "lm": ("lm/train.sh", missing, save),
                 "classification": ("classification/train.sh", "IMDB", missing, save),
                 "glue": ("glue/finetune.sh", "RTE", missing, checkpoint, save),
                 "race": ("race/finetune.sh", missing, checkpoint, save),
                 "lm preprocess": ("lm/preprocess.sh", missing, save),
                 "floater_warmstart": ("translation/floater_warmstart.sh", missing, save)}[case]
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


def test_freeze_dynamics_takes_one_or_zero(made, tmp_path):
    """Before, FREEZE_DYNAMICS=yes trained the dynamics along (only the exact value 1 froze them)."""
    data, checkpoint = made
    done = script("floater_pretrain/finetune.sh", "race", data, checkpoint, tmp_path / "save", FREEZE_DYNAMICS="yes")
    assert refused(done, "FREEZE_DYNAMICS=yes: give 1 (frozen) or 0 (trained along)"), done.stderr
