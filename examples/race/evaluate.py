#!/usr/bin/env python
"""RACE accuracy on the middle (test) and high (test1) test sets, and on both together, with
fairseq-validate as in fairseq's README.race.md.

  python examples/race/evaluate.py DATA_BIN CHECKPOINT [--cpu] [--json out.json] [--subsets test,test1]

Prints `RACE middle accuracy = x`, `RACE high accuracy = y` and `RACE all accuracy = z` (weighted by
the number of questions, the paper's "Accuracy" column).
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMES = {"test": "middle", "test1": "high", "valid": "dev"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_bin", type=Path)
    p.add_argument("checkpoint")
    p.add_argument("--subsets", default="test,test1")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    exe = Path(sys.executable).parent / "fairseq-validate"
    command = [str(exe if exe.exists() else "fairseq-validate"), str(args.data_bin), "--path", args.checkpoint,
               "--user-dir", str(REPO / "posenc_fairseq"), "--valid-subset", args.subsets, "--batch-size", "1",
               "--task", "sentence_ranking", "--criterion", "sentence_ranking", "--num-workers", "0"]
    if args.cpu:
        command.append("--cpu")
    done = subprocess.run(command, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        sys.stderr.write(output[-6000:])
        raise SystemExit(f"fairseq-validate failed ({done.returncode})")
    results, total, correct = {}, 0, 0.0
    for subset in args.subsets.split(","):
        match = re.search(rf"valid on '{re.escape(subset)}' subset \|.*?\| accuracy ([0-9.]+)", output)
        if not match:
            sys.stderr.write(output[-4000:])
            raise SystemExit(f"no accuracy for subset {subset} in fairseq-validate's output")
        accuracy = float(match.group(1))
        label_file = args.data_bin / "label" / f"{subset}.label"
        count = len(label_file.read_text().split()) if label_file.exists() else 0
        results[NAMES.get(subset, subset)] = {"accuracy": accuracy, "questions": count}
        total, correct = total + count, correct + accuracy * count
        print(f"RACE {NAMES.get(subset, subset)} accuracy = {accuracy:.2f} (n={count})")
    if total:
        results["all"] = {"accuracy": correct / total, "questions": total}
        print(f"RACE all accuracy = {correct / total:.2f} (n={total})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
