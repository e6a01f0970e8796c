#!/usr/bin/env python
"""RACE accuracy on the middle (test) and high (test1) test sets, and on both together, with the
checkpoint's sentence_ranking criterion as fairseq-validate runs it (fairseq's README.race.md).

  python examples/race/evaluate.py DATA_BIN CHECKPOINT [--cpu] [--json out.json] [--subsets test,test1]

Prints `RACE middle accuracy = x`, `RACE high accuracy = y` and `RACE all accuracy = z` (weighted by
the number of questions, the paper's "Accuracy" column), each from the number of questions answered
right (examples/checkpoint_eval.py): fairseq-validate logs the accuracy rounded to 0.1% only, too
coarse for two decimals and for combining the two sets.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint_eval import count_correct, load_checkpoint  # noqa: E402
from script_helpers import at_least, check_output, write_output  # noqa: E402

NAMES = {"test": "middle", "test1": "high", "valid": "dev"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_bin", type=Path)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--subsets", default="test,test1")
    p.add_argument("--batch-size", type=at_least(1), default=1)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not args.data_bin.is_dir():
        p.error(f"no folder {args.data_bin}")
    if args.json:
        check_output(args.json, [args.data_bin, args.checkpoint], p.error)
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    model, cfg, task = load_checkpoint(args.checkpoint, args.data_bin, cpu)
    results, all_correct, all_questions = {}, 0, 0
    for subset in args.subsets.split(","):
        correct, questions, _ = count_correct(model, cfg, task, subset, args.batch_size, cpu)
        if not questions:
            raise SystemExit(f"error: no questions in subset {subset} of {args.data_bin}")
        name = NAMES.get(subset, subset)
        results[name] = {"accuracy": 100 * correct / questions, "correct": correct, "questions": questions}
        all_correct, all_questions = all_correct + correct, all_questions + questions
        print(f"RACE {name} accuracy = {100 * correct / questions:.2f} ({correct} of {questions} right)", flush=True)
    results["all"] = {"accuracy": 100 * all_correct / all_questions, "correct": all_correct,
                      "questions": all_questions}
    print(f"RACE all accuracy = {100 * all_correct / all_questions:.2f} ({all_correct} of {all_questions} right)")
    if args.json:
        write_output(args.json, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
