"""Session-wide fixtures: generated data, binarised once per test session."""
import pytest

from posenc_fairseq.toy_data import monolingual_corpus, parallel_corpus, write_parallel
from util import run


@pytest.fixture(scope="session")
def translation_data(tmp_path_factory):
    """A toy parallel corpus binarised by fairseq-preprocess (word level, joined dictionary)."""
    root = tmp_path_factory.mktemp("translation")
    raw = write_parallel(root / "raw", {
        "train": parallel_corpus(300), "valid": parallel_corpus(30, seed=3), "test": parallel_corpus(20, seed=4)})
    run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test",
         "--destdir", root / "bin", "--joined-dictionary", "--workers", "1"])
    return root / "bin"


@pytest.fixture(scope="session")
def masked_lm_data(tmp_path_factory):
    """A toy monolingual corpus binarised for --task masked_lm."""
    root = tmp_path_factory.mktemp("mlm")
    (root / "train.txt").write_text("\n".join(monolingual_corpus(300)) + "\n")
    (root / "valid.txt").write_text("\n".join(monolingual_corpus(30, seed=5)) + "\n")
    run(["fairseq-preprocess", "--only-source", "--trainpref", root / "train.txt",
         "--validpref", root / "valid.txt", "--destdir", root / "bin", "--workers", "1"])
    return root / "bin"


@pytest.fixture(scope="session")
def tiny_checkpoint(translation_data, tmp_path_factory):
    """Factory: `tiny_checkpoint(arch, *options)` -> checkpoint_last.pt of a tiny model trained by
    fairseq-train for 2 updates on translation_data (cached per arch and options)."""
    from util import QUICK_TRAIN, TINY_TRANSFORMER, USER_DIR

    made = {}

    def make(arch, *options):
        key = (arch, *map(str, options))
        if key not in made:
            save = tmp_path_factory.mktemp(arch)
            run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", arch, *TINY_TRANSFORMER,
                 *QUICK_TRAIN, *options, "--max-update", "2", "--save-dir", save])
            made[key] = save / "checkpoint_last.pt"
        return made[key]

    return make
