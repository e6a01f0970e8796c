#!/usr/bin/env python
"""Process-50 (AT5 paper, Wu et al. AAAI 2021, table 1): does an encoder learn relative order?

Every sequence is 50 binary symbols from one of two 2-state Markov chains that differ only in how
often a symbol repeats its predecessor: P(same as previous) = 0.57 (class 0) or 0.43 (class 1),
the first symbol uniform. Both chains have the uniform stationary distribution, so the symbol
counts say nothing; only neighbour comparisons tell the class, and the Bayes classifier (count the
49 repeats, compare with 24.5) is right with probability ~0.839 (printed exactly). The paper's text
gives no transition matrices; the authors' generator (text_classification/gen_data_utils/
t2_process.py in their repository) uses other, asymmetric ones.

    python examples/claims/process50.py --out work/process50 \
        --arch roberta_nope roberta_t5 roberta_at5 "roberta_at5:--at5-length-scale 50"

writes OUT/raw (text and labels), OUT/bin (fairseq-preprocess), trains each architecture with
fairseq-train --task sentence_prediction (the model and training options below, the same for all;
an entry ARCH:OPTIONS adds OPTIONS to that run), keeps the checkpoint of the best validation
accuracy, scores it on the test set with fairseq-validate, and prints a markdown table (also in
OUT/results.md). Each run's log is OUT/ARCH.../train.log.
"""
import argparse
import math
import os
import random
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER_DIR = REPO / "posenc_fairseq"
BIN = Path(sys.executable).parent
LENGTH = 50
REPEAT_PROBABILITY = (0.57, 0.43)  # P(symbol == previous symbol) of class 0 and class 1
#: the paper's table 1 (Process-50 accuracy), by architecture
PAPER = {"roberta_nope": 0.549, "roberta_t5_nob": 0.772, "roberta_t5": 0.808, "roberta_at5_nob": 0.843,
         "roberta_at5": 0.843}
MODEL = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "256",
         "--encoder-attention-heads", "4"]
TRAIN = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr-scheduler", "inverse_sqrt",
         "--warmup-updates", "100", "--dropout", "0.1", "--attention-dropout", "0.1", "--clip-norm", "1.0",
         "--criterion", "sentence_prediction", "--best-checkpoint-metric", "accuracy",
         "--maximize-best-checkpoint-metric", "--no-epoch-checkpoints", "--no-last-checkpoints",
         "--log-format", "simple", "--num-workers", "0", "--cpu"]


def sequence(repeat: float, rng: random.Random):
    symbols = [rng.randrange(2)]
    while len(symbols) < LENGTH:
        symbols.append(symbols[-1] if rng.random() < repeat else 1 - symbols[-1])
    return symbols


def bayes_accuracy(repeat=REPEAT_PROBABILITY) -> float:
    """Accuracy of the optimal classifier: with equal priors it picks the class whose chain makes the
    observed number of repeats r (of LENGTH - 1) likelier, i.e. class 0 iff r > (LENGTH - 1) / 2."""
    n, (p, q) = LENGTH - 1, repeat
    correct = 0.0
    for r in range(n + 1):
        likelihood = [math.comb(n, r) * p ** r * (1 - p) ** (n - r), math.comb(n, r) * q ** r * (1 - q) ** (n - r)]
        correct += 0.5 * max(likelihood)
    return correct


def write_split(folder: Path, split: str, count: int, rng: random.Random, repeat=REPEAT_PROBABILITY):
    """count sequences, classes alternating (balanced), as fairseq's sentence_prediction inputs."""
    with open(folder / f"{split}.input0", "w") as text, open(folder / f"{split}.label", "w") as labels:
        for index in range(count):
            label = index % 2
            text.write(" ".join(map(str, sequence(repeat[label], rng))) + "\n")
            labels.write(f"{label}\n")


def run(command, log: Path, env):
    command = [str(part) for part in command]
    if (BIN / command[0]).exists():
        command[0] = str(BIN / command[0])
    with open(log, "a") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); see {log}:\n" + log.read_text()[-3000:])


def prepare(out: Path, sizes, seed: int, env, repeat=REPEAT_PROBABILITY):
    raw, data = out / "raw", out / "bin"
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, count in zip(("train", "valid", "test"), sizes):
        write_split(raw, split, count, rng, repeat)
    log = out / "preprocess.log"
    log.write_text("")
    for field in ("input0", "label"):
        run(["fairseq-preprocess", "--only-source", "--workers", "1", "--destdir", data / field,
             *(option for split in ("train", "valid", "test")
               for option in (f"--{split}pref", raw / f"{split}.{field}"))], log, env)
    return data


def accuracy_from(text: str, subset: str):
    """The last accuracy fairseq reported on `subset` (a fraction), None if none."""
    found = re.findall(rf"on '{subset}' subset.*?\| accuracy ([0-9.]+)", text)
    return float(found[-1]) / 100 if found else None


def train_and_test(entry: str, data: Path, out: Path, args, env):
    arch, _, extra = entry.partition(":")
    work = out / re.sub(r"[^A-Za-z0-9_.-]+", "_", entry).strip("_")
    work.mkdir(parents=True, exist_ok=True)
    log = work / "train.log"
    log.write_text("")
    start = time.time()
    run(["fairseq-train", data, "--user-dir", USER_DIR, "--task", "sentence_prediction", "--num-classes", "2",
         "--max-positions", str(LENGTH + 2), "--arch", arch, *MODEL, *TRAIN, "--lr", str(args.lr),
         "--batch-size", str(args.batch_size), "--max-epoch", str(args.epochs), "--seed", str(args.seed),
         "--save-dir", work / "checkpoints", *shlex.split(extra)], log, env)
    minutes = (time.time() - start) / 60
    checkpoint = work / "checkpoints" / "checkpoint_best.pt"
    test_log = work / "test.log"
    test_log.write_text("")
    options = shlex.split(extra)
    user_dir = options[options.index("--user-dir") + 1] if "--user-dir" in options else USER_DIR  # last one wins
    run(["fairseq-validate", data, "--user-dir", user_dir, "--task", "sentence_prediction",
         "--criterion", "sentence_prediction", "--path", checkpoint, "--valid-subset", "test",
         "--batch-size", "256", "--cpu"], test_log, env)
    valid = [float(x) / 100 for x in re.findall(r"\| valid \|.*?\| accuracy ([0-9.]+)", log.read_text())]
    return {"entry": entry, "arch": arch, "test": accuracy_from(test_log.read_text(), "test"),
            "valid": max(valid) if valid else None, "minutes": minutes}


def table(results, args) -> str:
    paper_task = tuple(args.repeat) == REPEAT_PROBABILITY
    lines = [f"Process-50 (P(repeat) {args.repeat[0]:g} / {args.repeat[1]:g}): {args.train} training / "
             f"{args.valid} validation / {args.test} test sequences, {args.epochs} epochs, batch {args.batch_size}, "
             f"lr {args.lr}; Bayes rate {bayes_accuracy(args.repeat):.3f}", "",
             "| run | test acc | best valid acc | paper | minutes |", "|---|---|---|---|---|"]
    for result in results:
        paper = PAPER.get(result["arch"]) if ":" not in result["entry"] and paper_task else None
        cells = [f"`{result['entry']}`", *(f"{result[k]:.3f}" if result.get(k) is not None else "failed"
                                            for k in ("test", "valid")),
                 f"{paper:.3f}" if paper else "", f"{result['minutes']:.1f}" if "minutes" in result else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--arch", nargs="+", default=["roberta_nope", "roberta_t5_nob", "roberta_t5",
                                                      "roberta_at5_nob", "roberta_at5"],
                        help="architectures, each ARCH or ARCH:OPTIONS (extra fairseq-train options of that run)")
    parser.add_argument("--train", type=int, default=5000, help="training sequences (paper: 5000)")
    parser.add_argument("--valid", type=int, default=1000, help="validation sequences (best epoch)")
    parser.add_argument("--test", type=int, default=5000, help="test sequences (paper: 5000)")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per update (paper's code: 64)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1, help="data and training seed")
    parser.add_argument("--repeat", type=float, nargs=2, default=REPEAT_PROBABILITY, metavar=("P0", "P1"),
                        help="P(symbol == previous) of class 0 and 1; default 0.57 0.43 (an easier proxy: 0.75 0.25)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each command")
    parser.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    args = parser.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    data = prepare(args.out, (args.train, args.valid, args.test), args.seed, env, tuple(args.repeat))

    def one(entry):
        try:
            result = train_and_test(entry, data, args.out, args, env)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            result = {"entry": entry, "arch": entry.partition(":")[0]}
        print(f"{entry}: test accuracy {result.get('test')}", file=sys.stderr, flush=True)
        return result

    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own fairseq process
        results = list(pool.map(one, args.arch))
    text = table(results, args)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0 if all(result.get("test") is not None for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
