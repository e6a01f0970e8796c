"""Session-wide set-up: each pytest-xdist worker's share of the cores, the `slow` marker (slow tests
start first), and generated data and tiny checkpoints, each made once per test run and shared by the
workers (util.built_once)."""
import hashlib
import os

import pytest
import torch

from posenc_fairseq.toy_data import monolingual_corpus, parallel_corpus, write_parallel
import fork_server
from util import (COMMAND_VARIABLES, QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, built_once, command_env,
                  run)

# --device cpu|cuda, the `device` fixture and marker, and the bounds per device (tests/devices.py)
pytest_plugins = ["devices"]

# Every pytest-xdist worker is a process of its own: torch's default of one intra-op thread per core in
# each of them oversubscribes the cores, and the tiny models' many small operations then wait on each
# other (docs/benchmarks.md, "The test suite"). Each worker, and each command it starts, gets its share
# of the cores instead, unless OMP_NUM_THREADS says otherwise.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // WORKERS))
    torch.set_num_threads(max(1, cores // WORKERS))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long end-to-end run (a recipe, a claim, README's commands, several fairseq "
                   "commands or processes); `make test-fast` (pytest -m 'not slow') skips them, `make test` "
                   "runs everything")


def pytest_collection_modifyitems(config, items):
    """The slow tests first, otherwise in collection order: under xdist the long runs start while
    there is still other work to share, and the workers finish together."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def fork_server_for_commands(tmp_path_factory):
    """fairseq's commands and the repository's scripts, run by the tests, start from a process that has
    imported torch and fairseq already (tests/fork_server): the same run without seconds of imports
    each. POSENC_TEST_FORK_SERVER=off runs every command as a new process."""
    if os.environ.get("POSENC_TEST_FORK_SERVER", "").lower() == "off":
        yield None
        return
    server, callers = fork_server.start(tmp_path_factory.mktemp("fork_server"), command_env())
    # every process a test starts, also with a copy of os.environ rather than command_env(), starts as
    # the server did (else it runs as a new process: server.log names what differed)
    exported = dict(COMMAND_VARIABLES, **callers)
    saved = {name: os.environ.get(name) for name in exported}
    os.environ.update(exported)
    yield server
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    fork_server.stop(server)


@pytest.fixture(scope="session")
def translation_data(tmp_path_factory):
    """A toy parallel corpus binarised by fairseq-preprocess (word level, joined dictionary)."""
    def build(root):
        raw = write_parallel(root / "raw", {
            "train": parallel_corpus(300), "valid": parallel_corpus(30, seed=3), "test": parallel_corpus(20, seed=4)})
        run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
             "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test",
             "--destdir", root / "bin", "--joined-dictionary", "--workers", "1"])

    return built_once(tmp_path_factory, "translation", build) / "bin"


@pytest.fixture(scope="session")
def masked_lm_data(tmp_path_factory):
    """A toy monolingual corpus binarised for --task masked_lm."""
    def build(root):
        (root / "train.txt").write_text("\n".join(monolingual_corpus(300)) + "\n")
        (root / "valid.txt").write_text("\n".join(monolingual_corpus(30, seed=5)) + "\n")
        run(["fairseq-preprocess", "--only-source", "--trainpref", root / "train.txt",
             "--validpref", root / "valid.txt", "--destdir", root / "bin", "--workers", "1"])

    return built_once(tmp_path_factory, "mlm", build) / "bin"


@pytest.fixture(scope="session")
def tiny_checkpoint(translation_data, tmp_path_factory):
    """Factory: `tiny_checkpoint(arch, *options)` -> checkpoint_last.pt of a tiny model trained by
    fairseq-train for 2 updates on translation_data (made once per arch and options)."""
    def make(arch, *options):
        options = [str(option) for option in options]
        name = f"{arch}-{hashlib.sha1(' '.join(options).encode()).hexdigest()[:10]}"
        return built_once(tmp_path_factory, name, lambda save: run([
            "fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", arch, *TINY_TRANSFORMER,
            *QUICK_TRAIN, *options, "--max-update", "2", "--save-dir", save])) / "checkpoint_last.pt"

    return make


@pytest.fixture(scope="session")
def stock_transformer_checkpoint(translation_data, tmp_path_factory):
    """checkpoint_last.pt of a tiny transformer trained for 2 updates by STOCK fairseq (no --user-dir)."""
    return built_once(tmp_path_factory, "stock_transformer", lambda save: run([
        "fairseq-train", translation_data, "--task", "translation", "--arch", "transformer", *TINY_TRANSFORMER,
        *QUICK_TRAIN, "--max-update", "2", "--save-dir", save])) / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def stock_roberta_checkpoint(masked_lm_data, tmp_path_factory):
    """checkpoint_last.pt of a tiny RoBERTa trained for 2 updates by STOCK fairseq (masked_lm)."""
    return built_once(tmp_path_factory, "stock_roberta", lambda save: run([
        "fairseq-train", masked_lm_data, "--task", "masked_lm", "--criterion", "masked_lm", "--arch", "roberta_base",
        "--tokens-per-sample", "64", *TINY_ROBERTA, *QUICK_TRAIN, "--max-update", "2",
        "--save-dir", save])) / "checkpoint_last.pt"
