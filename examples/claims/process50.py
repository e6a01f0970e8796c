#!/usr/bin/env python
"""Process-50 (AT5 paper, Wu et al. AAAI 2021, table 1): does an encoder learn relative order?

Every sequence is 50 binary symbols from one of two 2-state Markov chains that differ only in how
often a symbol repeats its predecessor: P(same as previous) = 0.57 (class 0) or 0.43 (class 1),
the first symbol uniform. Both chains have the uniform stationary distribution, so the symbol
counts say nothing; only neighbour comparisons tell the class, and the Bayes classifier (count the
49 repeats, compare with 24.5) is right with probability ~0.839 (printed exactly). The paper's text
gives no transition matrices; the authors' generator (text_classification/gen_data_utils/
t2_process.py in their repository) uses other, asymmetric ones.

`--lag K --length N` is the same task at a longer range (not in the paper): each symbol repeats the one
K places before it (the first K uniform), so a model must single out distance K instead of 1; it
shows what an encoding's resolution at long distances costs or buys (docs/claims.md, 1b).

    python examples/claims/process50.py --out work/process50 \
        --arch roberta_nope roberta_t5 roberta_at5 "roberta_at5:--at5-length-scale 50"

writes OUT/raw (text and labels), OUT/bin (fairseq-preprocess), trains each architecture with
fairseq-train --task sentence_prediction (the model and training options below, the same for all;
an entry ARCH:OPTIONS adds OPTIONS to that run), keeps the checkpoint of the best validation
accuracy, counts its right answers on the valid and test sets (examples/checkpoint_eval.py, fairseq's
criterion), and prints a markdown table (also in OUT/results.md). Each run's logs are
OUT/ARCH.../train.log and test.log.
"""
import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import add_common_args, generate_and_run, report, table  # noqa: E402

LENGTH = 50
REPEAT_PROBABILITY = (0.57, 0.43)  # P(symbol == previous symbol) of class 0 and class 1
#: the paper's table 1 (Process-50 accuracy), by architecture
PAPER = {"roberta_nope": 0.549, "roberta_t5_nob": 0.772, "roberta_t5": 0.808, "roberta_at5_nob": 0.843,
         "roberta_at5": 0.843}


def model_options(length: int = LENGTH) -> list:
    return ["--num-classes", "2", "--max-positions", str(length + 2), "--encoder-layers", "2",
            "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "256", "--encoder-attention-heads", "4"]


MODEL = model_options()


def sequence(repeat: float, rng: random.Random, length: int = LENGTH, lag: int = 1):
    """`length` symbols; the first `lag` uniform, then each equal to the one `lag` places before it
    with probability `repeat`."""
    symbols = [rng.randrange(2) for _ in range(min(lag, length))]
    while len(symbols) < length:
        earlier = symbols[-lag]
        symbols.append(earlier if rng.random() < repeat else 1 - earlier)
    return symbols


def bayes_accuracy(repeat=REPEAT_PROBABILITY, length: int = LENGTH, lag: int = 1) -> float:
    """Accuracy of the optimal classifier: with equal priors it picks the class whose chain makes the
    observed number of repeats r (of n = length - lag comparisons at that lag, independent given the
    class) likelier, i.e. for repeat (p, 1 - p) class 0 iff r > n / 2."""
    n, (p, q) = length - lag, repeat
    correct = 0.0
    for r in range(n + 1):
        likelihood = [math.comb(n, r) * p ** r * (1 - p) ** (n - r), math.comb(n, r) * q ** r * (1 - q) ** (n - r)]
        correct += 0.5 * max(likelihood)
    return correct


def write_split(folder: Path, split: str, count: int, rng: random.Random, repeat=REPEAT_PROBABILITY,
                length: int = LENGTH, lag: int = 1):
    """count sequences, classes alternating (balanced), as fairseq's sentence_prediction inputs."""
    with open(folder / f"{split}.input0", "w") as text, open(folder / f"{split}.label", "w") as labels:
        for index in range(count):
            label = index % 2
            text.write(" ".join(map(str, sequence(repeat[label], rng, length, lag))) + "\n")
            labels.write(f"{label}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, epochs=40, arch=["roberta_nope", "roberta_t5_nob", "roberta_t5", "roberta_at5_nob",
                                            "roberta_at5"])
    parser.add_argument("--train", type=int, default=5000, help="training sequences (paper: 5000)")
    parser.add_argument("--valid", type=int, default=1000, help="validation sequences (best epoch)")
    parser.add_argument("--test", type=int, default=5000, help="test sequences (paper: 5000)")
    parser.add_argument("--repeat", type=float, nargs=2, default=REPEAT_PROBABILITY, metavar=("P0", "P1"),
                        help="P(symbol == previous) of class 0 and 1; default 0.57 0.43 (an easier proxy: 0.75 0.25)")
    parser.add_argument("--length", type=int, default=LENGTH, help=f"symbols per sequence (paper: {LENGTH})")
    parser.add_argument("--lag", type=int, default=1,
                        help="distance of the symbol each one repeats (paper: 1); 1 <= LAG < LENGTH")
    args = parser.parse_args(argv)
    if not 1 <= args.lag < args.length:
        parser.error(f"--lag {args.lag} --length {args.length}: expected 1 <= LAG < LENGTH")
    shape = dict(length=args.length, lag=args.lag)
    results = generate_and_run(args, model_options(args.length), lambda folder, split, count, rng:
                               write_split(folder, split, count, rng, tuple(args.repeat), **shape))
    paper_shape = shape == dict(length=LENGTH, lag=1)
    paper_task = paper_shape and tuple(args.repeat) == REPEAT_PROBABILITY
    name = "Process-50" if paper_shape else f"Process at lag {args.lag}, length {args.length}"
    heading = (f"{name} (P(repeat) {args.repeat[0]:g} / {args.repeat[1]:g}): {args.train} training / "
               f"{args.valid} validation / {args.test} test sequences, {args.epochs} epochs, batch {args.batch_size}, "
               f"lr {args.lr}; Bayes rate {bayes_accuracy(args.repeat, **shape):.3f}")
    paper = {arch: f"{value:.3f}" for arch, value in PAPER.items()} if paper_task else {}
    return report(args, results, table(results, heading, paper))


if __name__ == "__main__":
    sys.exit(main())
