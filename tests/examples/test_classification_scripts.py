"""examples/classification/preprocess.py on tiny IMDB / SNLI folders (tests/examples/classification_data.py):
a wrong folder is refused before anything is written, and a run leaves nothing beside its output."""
import pytest

from classification_data import write_imdb, write_snli
from recipe_data import WORDS
from util import REPO, load_script

PREPROCESS = REPO / "examples" / "classification" / "preprocess.py"


@pytest.fixture
def dictionary(tmp_path):
    (tmp_path / "dict.txt").write_text("".join(f"{word} 1\n" for word in WORDS))
    return tmp_path / "dict.txt"


@pytest.mark.parametrize("task,wrong,message", [
    ("IMDB", "aclImdb_typo", "no folder"),  # a mistyped folder
    ("IMDB", "raw", "no train/neg in"),  # the folder above aclImdb
    ("SNLI", "raw", "no snli_1.0_train.jsonl in"),
])
def test_preprocess_refuses_a_wrong_folder_before_writing_anything(task, wrong, message, dictionary, tmp_path,
                                                                   capsys):
    write_imdb(tmp_path / "raw")
    write_snli(tmp_path / "raw")
    out = tmp_path / "data" / f"{task}-bin"
    with pytest.raises(SystemExit) as exit_info:
        load_script(PREPROCESS).main([task, str(tmp_path / wrong), str(out), "--bpe", "none", "--dict", str(dictionary),
                                      "--workers", "1"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # no folder made, no stray intermediate folder beside OUT_DIR


def test_preprocess_leaves_only_its_output(dictionary, tmp_path):
    out = tmp_path / "data" / "IMDB-bin"
    load_script(PREPROCESS).main(["IMDB", str(write_imdb(tmp_path / "raw")), str(out), "--bpe", "none",
                                  "--dict", str(dictionary), "--workers", "1"])
    assert [path.name for path in out.parent.iterdir()] == ["IMDB-bin"]
    assert {"input0", "label"} <= {path.name for path in out.iterdir()}


@pytest.mark.parametrize("case", ["RAW_DIR", "the folder above RAW_DIR", "--dict's folder"])
def test_preprocess_refuses_an_out_dir_that_is_or_holds_an_input(case, dictionary, tmp_path, capsys):
    """Before, the input went with the earlier OUT_DIR that the new one replaced, and the run said it
    had binarised the task."""
    raw = write_imdb(tmp_path / "raw")
    own = tmp_path / "dicts" / "dict.txt"  # (a folder of its own: the one above the fixture's holds RAW_DIR too)
    own.parent.mkdir()
    own.write_bytes(dictionary.read_bytes())
    dictionary = own
    out = {"RAW_DIR": raw, "the folder above RAW_DIR": raw.parent, "--dict's folder": dictionary.parent}[case]
    before = {path: None if path.is_dir() else path.read_bytes() for path in tmp_path.rglob("*")}
    with pytest.raises(SystemExit) as exit_info:
        load_script(PREPROCESS).main(["IMDB", str(raw), str(out), "--bpe", "none", "--dict", str(dictionary),
                                      "--workers", "1"])
    assert exit_info.value.code == 2 and f"{out} would replace an input (" in capsys.readouterr().err
    assert {path: None if path.is_dir() else path.read_bytes() for path in tmp_path.rglob("*")} == before
