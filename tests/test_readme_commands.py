"""Every command line README.md documents (shell blocks, and inline commands in the text) runs as
written, or is listed here with the reason it cannot run in a test.

What a test may change, and nothing else: placeholders (DATA-BIN, DATA, CHECKPOINT = a tiny
classifier that the test trains for checkpoint_eval.py, whose DATA-BIN is its data; `...` = tiny model and
training options, R and PORT of the per-rank command), training lengths (`--max-update`, and
`--workdir` for the demo so it writes into a temporary folder; `make -o .venv/.installed` so that a
test never rebuilds the environment), `python` = this interpreter, and
`work/demo/` = that folder (`work/demo/data/bin` = the small translation corpus of the tests). Commands run in a temporary folder with `posenc_fairseq` linked into it,
so `--user-dir posenc_fairseq` and `checkpoints/...` resolve as they would in a user's checkout;
they run in README's order, in one test, and a command that reads `checkpoints/` reads what the training command
before it wrote (each training command starts with an empty `checkpoints/`).
(Python snippets are covered by tests/test_cli.py and tests/models/test_lm.py.)
"""
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from posenc_fairseq.toy_data import monolingual_corpus
from util import QUICK_TRAIN, REPO, TINY_ROBERTA, TINY_TRANSFORMER, run

README = (REPO / "README.md").read_text()
COMMAND_WORDS = ("make ", "fairseq-", "python ", ".venv/bin/python ", "torchrun ")
TINY_LM = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
           "--decoder-attention-heads", "4", "--tokens-per-sample", "32"]
TRAIN = [option for option in QUICK_TRAIN if option != "--cpu"] + ["--max-update", "1"]

# commands that cannot run in a test: (pattern, reason)
CANNOT_RUN = [
    (r"^make test\b", "is this test suite"),
    (r"^torchrun --nproc_per_node", "needs GPUs (NCCL)"),
    (r"^fairseq-train \.\.\. --distributed-world-size 8", "needs 8 GPUs"),
    (r"--device cuda", "needs a GPU"),
]


def readme_commands():
    """Command lines of README's ```bash blocks (continuations joined, comments dropped) and the
    inline `code` spans of the text that start with a command."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    text = re.sub(r"```.*?```", "", README, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", text):
        # `fairseq-generate`, `fairseq-train --restore-file`: names in the text, not command lines
        named_only = span.startswith("fairseq-") and not re.search(r"\bDATA(-BIN)?\b|\.\.\.", span)
        if span.startswith(COMMAND_WORDS) and not named_only and span not in commands:
            commands.append(span)
    return commands


COMMANDS = readme_commands()


def cannot_run(command):
    return next((reason for pattern, reason in CANNOT_RUN if re.search(pattern, command)), None)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder like a user's checkout: posenc_fairseq and scripts reachable by relative paths."""
    root = tmp_path_factory.mktemp("readme")
    for name in ("posenc_fairseq", "scripts", "examples", "Makefile", "setup.py", ".venv"):
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    """Monolingual data with a test split (fairseq-eval-lm's default subset)."""
    root = tmp_path_factory.mktemp("lm")
    for split, count, seed in (("train", 200, 2), ("valid", 20, 5), ("test", 20, 6)):
        (root / f"{split}.txt").write_text("\n".join(monolingual_corpus(count, seed=seed)) + "\n")
    run(["fairseq-preprocess", "--only-source", "--trainpref", root / "train.txt", "--validpref", root / "valid.txt",
         "--testpref", root / "test.txt", "--destdir", root / "bin", "--workers", "1"])
    return root / "bin"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, lm_data, workspace):
    """(DATA-BIN, CHECKPOINT) of sentence_prediction: input0/ and label/ binarised (label = whether a
    sentence is longer than 6 words), and a tiny roberta_t5 trained on it for one update."""
    root = tmp_path_factory.mktemp("classifier")
    for split, count, seed in (("train", 60, 3), ("valid", 12, 4), ("test", 12, 7)):
        sentences = monolingual_corpus(count, seed=seed)
        (root / f"{split}.input0").write_text("\n".join(sentences) + "\n")
        (root / f"{split}.label").write_text("".join(f"{'long' if len(s.split()) > 6 else 'short'}\n"
                                                     for s in sentences))
    for field in ("input0", "label"):
        run(["fairseq-preprocess", "--only-source", "--trainpref", root / f"train.{field}", "--validpref",
             root / f"valid.{field}", "--testpref", root / f"test.{field}", "--destdir", root / "bin" / field,
             "--workers", "1"] + (["--srcdict", lm_data / "dict.txt"] if field == "input0" else []))
    run(["fairseq-train", root / "bin", "--user-dir", "posenc_fairseq", "--task", "sentence_prediction",
         "--arch", "roberta_t5", "--num-classes", "2", "--criterion", "sentence_prediction",
         "--max-positions", "64", "--save-dir", root / "checkpoints"] + TINY_ROBERTA + TRAIN, cwd=workspace)
    return root / "bin", root / "checkpoints" / "checkpoint_best.pt"


def data_for(command, translation_data, lm_data):
    if "masked_lm" in command or "language_modeling" in command or "eval-lm" in command or "transformer_lm" in command:
        return lm_data  # monolingual (dict.txt, train, valid, test): masked_lm's and language_modeling's layout
    return translation_data


def tiny_options(command):
    arch = re.search(r"--arch (\S+)", command)
    arch = arch.group(1) if arch else ""
    if arch.startswith("roberta"):
        return TINY_ROBERTA + ["--tokens-per-sample", "64"]
    if arch.startswith("transformer_lm"):
        return TINY_LM
    return TINY_TRANSFORMER


def prepare(command, translation_data, lm_data, demo_dir, workspace, classifier=None):
    """The argv a test runs for README's `command` (`classifier`: the fixture's pair, or a function
    that makes it, for checkpoint_eval.py)."""
    data = str(data_for(command, translation_data, lm_data))
    if "examples/checkpoint_eval.py" in command:
        data_bin, checkpoint = classifier() if callable(classifier) else classifier
        data, command = str(data_bin), command.replace("CHECKPOINT", str(checkpoint))
    # the demo's binarised data: the (much smaller) test corpus of the same layout
    command = command.replace("work/demo/data/bin", str(translation_data))
    argv = shlex.split(command.replace("work/demo/", f"{demo_dir}/"))
    argv = [data if part in ("DATA-BIN", "DATA") else part for part in argv]
    if argv[0] == "python":
        argv[0] = sys.executable
    if argv[0] == ".venv/bin/python":
        argv[0] = str(REPO / ".venv" / "bin" / "python")
    if "--max-update" in argv:
        argv[argv.index("--max-update") + 1] = "1"
    if "..." in argv:
        at = argv.index("...")
        if argv[at - 1] == "--arch":  # `--arch ...`: any architecture
            argv[at: at + 1] = ["transformer_alibi"]
            at = len(argv)
        argv[at: at + 1] = tiny_options(" ".join(argv)) + TRAIN if argv[0] == "fairseq-train" else []
        if argv[0] == "fairseq-train" and "--save-dir" not in argv and (workspace / "checkpoints").exists():
            shutil.rmtree(workspace / "checkpoints")  # each training command starts afresh in checkpoints/
    if "examples/demo/run_demo.py" in argv or argv[:2] == ["make", "demo"]:
        options = ["--max-update", "2", "--workdir", str(demo_dir)]
        if argv[0] == "make":  # -o: never (re)build .venv/ from a test, even if setup.py is newer
            argv[1:1] = ["-o", ".venv/.installed"]
            given = [part for part in argv if part.startswith("DEMO_ARGS=")]
            argv = [part for part in argv if not part.startswith("DEMO_ARGS=")]
            argv.append(" ".join((given[-1] if given else "DEMO_ARGS=").split(" ") + options).replace("= ", "="))
        else:
            argv += options
    return argv


def test_every_readme_command_is_run_or_has_a_reason():
    assert len(COMMANDS) >= 8
    for command in COMMANDS:
        assert command.startswith(COMMAND_WORDS), command


def run_one(command, workspace, demo_dir, translation_data, lm_data, classifier):
    argv = prepare(command, translation_data, lm_data, demo_dir, workspace, classifier)
    if "--distributed-rank" in argv:  # one command per rank R
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        processes = []
        for rank in ("0", "1"):
            ranked = [part.replace("PORT", port) for part in argv]
            ranked[ranked.index("--distributed-rank") + 1] = rank
            ranked += ["--save-dir", str(workspace / "ddp")]
            processes.append(subprocess.Popen([str(REPO / ".venv" / "bin" / ranked[0])] + ranked[1:], cwd=workspace,
                                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [process.communicate(timeout=600)[0] for process in processes]
        assert all(process.returncode == 0 for process in processes), outputs[0][-3000:] + outputs[1][-3000:]
        return
    out = run(argv, cwd=workspace)
    if argv[0] == "make" or "run_demo.py" in " ".join(argv):
        assert re.search(r"test BLEU \(sacrebleu\) = [0-9.]+", out), out[-2000:]
    if "examples/checkpoint_eval.py" in " ".join(argv):
        for subset in re.search(r"--subsets (\S+)", command).group(1).split(","):
            assert re.search(rf"^{subset}: \d+ of 12 correct \(\d+\.\d\d%\)$", out, flags=re.M), out[-2000:]


@pytest.mark.slow
def test_readme_commands_run_in_order(workspace, demo_dir, translation_data, lm_data, request):
    """One test, README's order (a command may read what the one before wrote; also under xdist)."""
    failures, skipped = [], []
    for command in COMMANDS:
        reason = cannot_run(command)
        if reason:
            skipped.append(f"{command}: {reason}")
            continue
        try:
            run_one(command, workspace, demo_dir, translation_data, lm_data,
                    lambda: request.getfixturevalue("classifier"))
        except (AssertionError, subprocess.TimeoutExpired) as error:
            failures.append(f"$ {command}\n{str(error)[-3000:]}")
    print("not run here:\n" + "\n".join(skipped))
    assert not failures, "\n\n".join(failures)
