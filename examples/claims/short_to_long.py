#!/usr/bin/env python
"""FLOATER paper, figure 2 ("short to long"), at toy scale on CPU: train on short sentences, report
BLEU per source-length bin up to 3x the longest training sentence, FLOATER against sinusoidal.

  python examples/claims/short_to_long.py WORK [--variants sinusoidal,floater,floater_bounded] [--max-update 1000]

Task: the toy translation of posenc_fairseq.toy_data (every word mapped to its partner, the word
order reversed: the model must use positions). Training sources have 3-16 words; the test split
holds held-out sentences of 3-16 words (in-length) and sentences of 17-24 (up to 1.5x), 25-32
(up to 2x) and 33-48 words (beyond). The existing recipe's steps do the work:
examples/extrapolation/make_s2l.py (the split), examples/translation/prepare.py (word-level
sentencepiece, fairseq-preprocess), examples/translation/train.sh (one model per variant),
examples/translation/evaluate.py --bins 3,17,25,33, examples/extrapolation/report.py (WORK/s2l.md
and WORK/s2l.png). Model: 2+2 layers, d = 64, 4 heads, FFN 256; Adam, lr 2e-3, 300 warm-up updates,
4096 tokens per batch; every variant trains with the same seed and number of updates. Every FLOATER
variant is evaluated twice: as trained, and with `--floater-stop-position 17` set at loading
(--model-overrides; positions 0-16 are the ones training saw: 16 words and </s>), row NAME+stop17.
Measured results and what they show: docs/floater.md, "Length extrapolation: measured".
Run again in the same WORK, it keeps the data if --sentences and --per-bin are the same (WORK/data/
corpus.json) and redraws it otherwise, and every variant trains afresh (its old checkpoints removed).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from posenc_fairseq.toy_data import parallel_corpus, write_parallel  # noqa: E402

PYTHON = sys.executable
EXTRAPOLATION, TRANSLATION = REPO / "examples" / "extrapolation", REPO / "examples" / "translation"
TRAIN_LENGTHS = (3, 16)
TEST_BINS = [(3, 16), (17, 24), (25, 32), (33, 48)]  # in-length, up to 1.5x, up to 2x, beyond
MODEL = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
         "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
# name -> (architecture, options): the variants docs/floater.md reports
VARIANTS = {
    "sinusoidal": ("transformer_sinusoidal", []),
    "floater": ("transformer_floater", []),
    "floater_delta0.01": ("transformer_floater", ["--floater-delta", "0.01"]),
    "floater_autonomous": ("transformer_floater", ["--floater-autonomous"]),
    "floater_small_init": ("transformer_floater", ["--floater-init", "small"]),
    "floater_max_speed": ("transformer_floater", ["--floater-max-speed", "5"]),
    "floater_bounded": ("transformer_floater", ["--floater-max-speed", "5", "--floater-decay", "1"]),
}
STOP_POSITION = TRAIN_LENGTHS[1] + 1  # the first position training never saw (16 words + </s>: 0..16)


def make_corpus(raw: Path, sentences: int, per_bin: int):
    """Raw train = short pairs plus `per_bin` longer pairs per longer bin (make_s2l.py moves those to
    the test split); raw test = held-out short pairs (the in-length bin)."""
    low, high = TRAIN_LENGTHS
    longer = [pair for seed, (lo, hi) in enumerate(TEST_BINS[1:], start=10)
              for pair in parallel_corpus(per_bin, lo, hi, seed=seed)]
    write_parallel(raw, {"train": parallel_corpus(sentences, low, high, seed=1) + longer,
                         "valid": parallel_corpus(300, low, high, seed=2),
                         "test": parallel_corpus(per_bin, low, high, seed=3)})


def prepare_data(work: Path, sentences: int, per_bin: int, env):
    """WORK/data/bin for these sizes: kept from an earlier run with the same sizes (corpus.json, written
    last), drawn and binarised anew otherwise."""
    data, settings = work / "data", {"sentences": sentences, "per_bin": per_bin}
    stamp = data / "corpus.json"
    if (data / "bin" / "dict.src.txt").exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return data
    for folder in (work / "raw", work / "split", data):
        shutil.rmtree(folder, ignore_errors=True)
    make_corpus(work / "raw", sentences, per_bin)
    run([PYTHON, EXTRAPOLATION / "make_s2l.py", work / "raw", work / "split", "--src", "src", "--tgt", "tgt",
         "--threshold", str(TRAIN_LENGTHS[1] + 1)], env)
    run([PYTHON, TRANSLATION / "prepare.py", work / "split", data, "--src", "src", "--tgt", "tgt",
         "--model-type", "word", "--vocab-size", "200", "--workers", "1"], env)
    stamp.write_text(json.dumps(settings))
    return data


def run(command, env=None):
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run([str(c) for c in command], check=True, env=env)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path)
    p.add_argument("--variants", default="sinusoidal,floater,floater_bounded",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--sentences", type=int, default=10000, help="training sentences (default 10000)")
    p.add_argument("--per-bin", type=int, default=200, help="test sentences per length bin (default 200)")
    p.add_argument("--max-update", type=int, default=1000)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every step (default 1)")
    args, extra = p.parse_known_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), CPU="1", PYTHON=PYTHON,
               PATH=f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    work, data = args.work, args.work / "data"
    prepare_data(work, args.sentences, args.per_bin, env)
    results = []
    for name in args.variants.split(","):
        arch, options = VARIANTS[name]
        for old in (work / name).glob("checkpoint*.pt"):  # train.sh would resume from them
            old.unlink()
        run([TRANSLATION / "train.sh", data / "bin", work / name, *MODEL, *options, "--num-workers", "0",
             "--no-epoch-checkpoints", "--disable-validation", *extra],
            dict(env, ARCH=arch, LR="2e-3", WARMUP="300", MAX_TOKENS="4096", UPDATE_FREQ="1",
                 MAX_UPDATE=str(args.max_update), DROPOUT="0.1"))
        evaluations = [(name, [])]
        if arch == "transformer_floater":
            evaluations.append((f"{name}+stop{STOP_POSITION}",
                                ["--model-overrides", f"{{'floater_stop_position': {STOP_POSITION}}}"]))
        for row, overrides in evaluations:
            results.append(work / f"bleu_{row}.json")
            run([PYTHON, TRANSLATION / "evaluate.py", data / "bin", work / name / "checkpoint_last.pt", "--cpu",
                 "--beam", str(args.beam), "--bins", ",".join(str(lo) for lo, _ in TEST_BINS),
                 "--json", results[-1], *overrides], env)
    run([PYTHON, EXTRAPOLATION / "report.py", *results, "--out", work / "s2l"], env)


if __name__ == "__main__":
    main()
