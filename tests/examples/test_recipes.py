"""The examples/ recipes, end to end at toy scale: the same scripts a user runs on the real data, on
tiny generated data in the real formats, through the real fairseq commands, with tiny models and a
few updates. Each test asserts that the recipe prints its metric as a number in range. All of them
are slow (`make test-fast` skips them)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from posenc_fairseq.toy_data import parallel_corpus, write_parallel
from recipe_data import write_glue, write_race
from util import BIN, REPO, TINY_ROBERTA, TINY_TRANSFORMER, built_once, command_env, run

EXAMPLES = REPO / "examples"
CONVERT_ROBERTA = REPO / "scripts" / "convert_roberta_checkpoint.py"
CONVERT_TRANSFORMER = REPO / "scripts" / "convert_transformer_checkpoint.py"
PY = sys.executable
# the recipe scripts call fairseq-* and python from PATH
ENV = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHON": PY, "CPU": "1"}
# FLOATER at toy scale: one Euler step per token keeps the ODE cheap on CPU
FAST_FLOATER = ["--floater-method", "euler", "--floater-step-size", "0.1"]
TINY_RUN = ["--num-workers", "0", "--log-interval", "1"]
FAST_DECODE = ["--cpu", "--beam", "1", "--max-len-a", "1", "--max-len-b", "5", "--batch-size", "1"]

pytestmark = pytest.mark.slow
needs_roberta_conversion = pytest.mark.skipif(not CONVERT_ROBERTA.exists(),
                                              reason="scripts/convert_roberta_checkpoint.py not there yet")
needs_transformer_conversion = pytest.mark.skipif(not CONVERT_TRANSFORMER.exists(),
                                                  reason="scripts/convert_transformer_checkpoint.py not there yet")


def number(pattern, output, low=0.0, high=100.0):
    """The number the recipe printed after PATTERN, checked to lie in [low, high]."""
    match = re.search(pattern + r"\s*=\s*(-?[0-9.]+|nan)", output)
    assert match, f"no '{pattern} = <number>' in the output:\n{output[-3000:]}"
    value = float(match.group(1))
    assert low <= value <= high, f"{pattern} = {value} out of [{low}, {high}]"
    return value


# ---------------------------------------------------------------- shared data and checkpoints
# (each made once per test run, util.built_once: the recipes only read them)
@pytest.fixture(scope="module")
def spm_translation(tmp_path_factory):
    """A toy parallel corpus through the recipe's sentencepiece + fairseq-preprocess step."""
    def build(root):
        raw = write_parallel(root / "raw", {"train": parallel_corpus(200), "valid": parallel_corpus(20, seed=3),
                                            "test": parallel_corpus(12, seed=4)})
        out = run([PY, EXAMPLES / "translation" / "prepare.py", raw, root / "data", "--src", "src", "--tgt", "tgt",
                   "--vocab-size", "120", "--workers", "1"], env=ENV)
        assert (root / "data" / "spm.model").exists() and (root / "data" / "bin" / "train.src-tgt.src.bin").exists(), out

    return built_once(tmp_path_factory, "recipe_translation", build) / "data" / "bin"


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory, masked_lm_data, stock_roberta_checkpoint):
    """A tiny RoBERTa trained with STOCK fairseq (conftest), converted to FLOATER with the repository's script."""
    if not CONVERT_ROBERTA.exists():
        pytest.skip("scripts/convert_roberta_checkpoint.py not there yet")
    root = built_once(tmp_path_factory, "recipe_roberta", lambda root: run(
        [PY, CONVERT_ROBERTA, stock_roberta_checkpoint, root / "floater.pt", "--encoding", "floater", *FAST_FLOATER],
        env=ENV))
    return {"stock": stock_roberta_checkpoint, "floater": root / "floater.pt", "dict": masked_lm_data / "dict.txt",
            "mlm": masked_lm_data}


@pytest.fixture(scope="module")
def glue_bin(tmp_path_factory, masked_lm_data):
    """GLUE TSVs of a single-sentence task (CoLA), a pair classification task (MRPC) and the
    regression task (STS-B), binarised by the recipe's preprocessing."""
    def build(root):
        tasks = ["CoLA", "MRPC", "STS-B"]
        for task in tasks:
            write_glue(root / "glue_data", task)
        run([PY, EXAMPLES / "glue" / "preprocess_glue.py", root / "glue_data", ",".join(tasks), root / "bin",
             "--bpe", "none", "--dict", masked_lm_data / "dict.txt", "--workers", "1"], env=ENV)

    return built_once(tmp_path_factory, "recipe_glue", build) / "bin"


ROBERTA_FINETUNE_ENV = dict(ENV, ARCH="roberta_floater", MAX_POSITIONS="64")


# ---------------------------------------------------------------- 1. translation
def test_translation_recipe(spm_translation, tmp_path):
    run([EXAMPLES / "translation" / "train.sh", spm_translation, tmp_path / "ckpt", *TINY_TRANSFORMER, *TINY_RUN,
         "--no-epoch-checkpoints"],
        env=dict(ENV, ARCH="transformer_alibi", MAX_UPDATE="3", WARMUP="2", MAX_TOKENS="2000", UPDATE_FREQ="1"))
    out = run([PY, EXAMPLES / "translation" / "evaluate.py", spm_translation, tmp_path / "ckpt" / "checkpoint_last.pt",
               *FAST_DECODE, "--json", tmp_path / "bleu.json"], env=ENV)
    number(r"(?m)^BLEU", out)  # the overall line
    assert json.loads((tmp_path / "bleu.json").read_text())["sentences"] == 12  # every test sentence


@needs_transformer_conversion
def test_floater_warmstart_recipe(spm_translation, tmp_path):
    out = run([EXAMPLES / "translation" / "floater_warmstart.sh", spm_translation, tmp_path / "work",
               *TINY_TRANSFORMER, *TINY_RUN],
              env=dict(ENV, STOCK_EPOCHS="1", RETRAIN_EPOCHS="5", AVERAGE="5", WARMUP="2", MAX_TOKENS="4000",
                       UPDATE_FREQ="1", ENCODING_ARGS=" ".join(FAST_FLOATER), EVAL_ARGS=" ".join(FAST_DECODE)))
    assert "averaged 5 checkpoints" in out
    assert_floater_options(tmp_path / "work" / "floater" / "checkpoint_last.pt")  # given once, used in training
    number(r"(?m)^BLEU", out)
    assert (tmp_path / "work" / "floater" / "checkpoint5.pt").exists()


# ---------------------------------------------------------------- 2. GLUE
@needs_roberta_conversion
@pytest.mark.parametrize("task,metric,low", [("CoLA", "mcc", -100.0), ("MRPC", "f1", 0.0), ("STS-B", "pearson", -100.0)])
def test_glue_recipe(task, metric, low, tiny_roberta, glue_bin, tmp_path):
    run([EXAMPLES / "glue" / "finetune.sh", task, glue_bin / f"{task}-bin", tiny_roberta["floater"], tmp_path / "ckpt",
         *TINY_ROBERTA, *TINY_RUN, *FAST_FLOATER],
        env=dict(ROBERTA_FINETUNE_ENV, TOTAL_NUM_UPDATES="2", WARMUP_UPDATES="1"))
    out = run([PY, EXAMPLES / "glue" / "evaluate.py", task, glue_bin / f"{task}-bin",
               tmp_path / "ckpt" / "checkpoint_best.pt", "--cpu"], env=ENV)
    number(rf"{task} dev {metric}", out, low=low)  # nan is rejected: constant predictions are fine for MCC (0)
    if task == "MRPC":
        number(r"MRPC dev acc", out)
    if task == "STS-B":
        number(r"STS-B dev spearman", out, low=-100.0)


def train_steps(output):
    """(loss, accuracy, gnorm) of each training progress line: what a step computed, without timings."""
    return re.findall(r"train_inner \| epoch \d+: .*?loss=([^,]+), nll_loss=[^,]+, accuracy=([^,]+), .*?"
                      r"gnorm=([^,]+)", output)


@needs_roberta_conversion
@pytest.mark.parametrize("encoding", ["t5", "xl"])
def test_glue_recipe_from_a_converted_checkpoint_starts_as_stock(encoding, stock_roberta_checkpoint, glue_bin,
                                                                 tmp_path):
    """Fine-tuning a stock RoBERTa converted to ENCODING (examples/glue/README.md: ARCH=roberta_NAME and
    --input-positions stock) computes stock's first step: the same loss, accuracy and gradient norm
    of a freshly drawn classification head (the encoding starts as the identity and is built in its
    own random stream). Without --input-positions stock the encoding's default input embedding would
    drop RoBERTa's learned table: one `error:` line that says what to give."""
    converted = tmp_path / f"{encoding}.pt"
    run([PY, CONVERT_ROBERTA, stock_roberta_checkpoint, converted, "--encoding", encoding], env=ENV)
    finetune = [EXAMPLES / "glue" / "finetune.sh", "MRPC", glue_bin / "MRPC-bin"]
    env = dict(ENV, MAX_POSITIONS="64", TOTAL_NUM_UPDATES="1", WARMUP_UPDATES="1")
    stock = run([*finetune, stock_roberta_checkpoint, tmp_path / "stock", *TINY_ROBERTA, *TINY_RUN],
                env=dict(env, ARCH="roberta_base"))
    ours = run([*finetune, converted, tmp_path / encoding, *TINY_ROBERTA, *TINY_RUN, "--input-positions", "stock"],
               env=dict(env, ARCH=f"roberta_{encoding}"))
    assert len(train_steps(stock)) == 1 and train_steps(ours) == train_steps(stock)
    done = subprocess.run([str(part) for part in [*finetune, converted, tmp_path / "default", *TINY_ROBERTA, *TINY_RUN]],
                          capture_output=True, text=True, env=command_env(dict(env, ARCH=f"roberta_{encoding}")))
    assert done.returncode != 0
    last = done.stdout.strip().splitlines()[-1]  # (finetune.sh sends both streams to its log through tee)
    assert last.startswith("fairseq-train: error: Cannot load model parameters from checkpoint"), done.stdout[-3000:]
    assert ("--input-positions none (the encoding's default): the checkpoint's weights were trained or converted "
            "with the stock input embedding; give --input-positions stock") in last
    assert "Traceback" not in done.stdout


# ---------------------------------------------------------------- 3. RACE
@needs_roberta_conversion
def test_race_recipe(tiny_roberta, tmp_path):
    write_race(tmp_path / "RACE")
    run([PY, EXAMPLES / "race" / "preprocess_race.py", tmp_path / "RACE", tmp_path / "bin", "--bpe", "none",
         "--dict", tiny_roberta["dict"], "--workers", "1"], env=ENV)
    assert (tmp_path / "bin" / "label" / "test1.label").exists()
    run([EXAMPLES / "race" / "finetune.sh", tmp_path / "bin", tiny_roberta["floater"], tmp_path / "ckpt",
         *TINY_ROBERTA, *TINY_RUN, *FAST_FLOATER],
        env=dict(ROBERTA_FINETUNE_ENV, MAX_UPDATE="2", UPDATE_FREQ="2", MAX_OPTION_LENGTH="16"))
    out = run([PY, EXAMPLES / "race" / "evaluate.py", tmp_path / "bin", tmp_path / "ckpt" / "checkpoint_best.pt",
               "--cpu"], env=ENV)
    for level in ("middle", "high", "all"):
        number(rf"RACE {level} accuracy", out)
    assert "of 4 right)" in out and "of 8 right)" in out  # each level's questions counted, then all of them


def assert_floater_options(checkpoint):
    """The solver of FAST_FLOATER is the one the checkpoint's model was trained with (fairseq-train
    builds the model from its own options; --restore-file only loads the converted weights)."""
    model = torch.load(checkpoint, map_location="cpu", weights_only=False)["cfg"]["model"]
    model = model if isinstance(model, dict) else vars(model)
    assert (model["floater_method"], model["floater_step_size"]) == ("euler", 0.1), checkpoint


# ---------------------------------------------------------------- 4. FLOATER dynamics pre-training
@needs_roberta_conversion
def test_floater_pretrain_recipe(tiny_roberta, glue_bin, tmp_path):
    out = run([EXAMPLES / "floater_pretrain" / "pretrain_dynamics.sh", tiny_roberta["stock"], tiny_roberta["mlm"],
               tmp_path / "work", *TINY_ROBERTA, *TINY_RUN],
              env=dict(ENV, ARCH="roberta_floater", MAX_UPDATE="2", TOTAL_NUM_UPDATES="2", WARMUP_UPDATES="1",
                       TOKENS_PER_SAMPLE="64", BATCH_SIZE="8", UPDATE_FREQ="1", ENCODING_ARGS=" ".join(FAST_FLOATER)))
    trained = re.search(r"num\. shared model params: ([0-9,]+) \(num\. trained: ([0-9,]+)\)", out)
    assert trained, out[-3000:]
    total, dynamics = (int(x.replace(",", "")) for x in trained.groups())
    assert 0 < dynamics < total  # only the dynamics are trained
    dynamics_checkpoint = tmp_path / "work" / "dynamics" / "checkpoint_last.pt"
    assert_floater_options(dynamics_checkpoint)
    out = run([EXAMPLES / "floater_pretrain" / "finetune.sh", "glue", "MRPC", glue_bin / "MRPC-bin",
               dynamics_checkpoint, tmp_path / "ft", *TINY_ROBERTA, *TINY_RUN],
              env=dict(ROBERTA_FINETUNE_ENV, TOTAL_NUM_UPDATES="2", WARMUP_UPDATES="1", FREEZE_DYNAMICS="1",
                       ENCODING_ARGS=" ".join(FAST_FLOATER)))
    assert "--floater-freeze-dynamics" in out
    assert_floater_options(tmp_path / "ft" / "checkpoint_best.pt")
    out = run([PY, EXAMPLES / "glue" / "evaluate.py", "MRPC", glue_bin / "MRPC-bin",
               tmp_path / "ft" / "checkpoint_best.pt", "--cpu"], env=ENV)
    number(r"MRPC dev f1", out)


# ---------------------------------------------------------------- 5. length extrapolation
def test_extrapolation_recipe(tmp_path):
    raw = write_parallel(tmp_path / "raw", {"train": parallel_corpus(240, min_len=3, max_len=12),
                                            "valid": parallel_corpus(20, seed=3, min_len=3, max_len=8)})
    out = run([EXAMPLES / "extrapolation" / "run_s2l.sh", raw, tmp_path / "work", *TINY_TRANSFORMER, *TINY_RUN],
              env=dict(ENV, ENCODINGS="alibi sinusoidal", SRC="src", TGT="tgt", THRESHOLD="10", BINS="10,12",
                       VOCAB_SIZE="120", PREPARE_ARGS="--workers 1", MAX_UPDATE="3", WARMUP="2", MAX_TOKENS="2000",
                       UPDATE_FREQ="1", EVAL_ARGS=" ".join(FAST_DECODE)))
    table = (tmp_path / "work" / "s2l.md").read_text()
    for encoding in ("alibi", "sinusoidal"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {encoding} |"))
        scores = [float(x) for x in re.findall(r"\|\s*(-?[0-9.]+)", row)]
        assert scores and all(0 <= s <= 100 for s in scores), row
    assert (tmp_path / "work" / "s2l.png").stat().st_size > 0
    assert "BLEU[10,12)" in out and "BLEU[12,inf)" in out
