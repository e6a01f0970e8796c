#!/usr/bin/env python
"""Score a classifier trained by train.sh with the metric of the LFHC/GCDF paper's table 1.

  python examples/classification/evaluate.py TASK DATA_BIN CHECKPOINT [--subset S] [--cpu] [--skip-too-long]
                                             [--json out.json]

Metrics (percentages): accuracy for IMDB, SST-2, SNLI, QNLI; QQP the mean of accuracy and F1; MNLI the
mean of matched and mismatched accuracy. Subsets: IMDB `valid` (= its test reviews, see preprocess.py),
SNLI `test`, GLUE tasks their dev sets (`valid`; MNLI `valid` + `valid1`). Prints
`TASK <metric> = <value>` (and the parts it averages).
"""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
import posenc_fairseq  # noqa: E402,F401
from script_helpers import write_output  # noqa: E402

# loading, prediction and metrics of examples/glue/evaluate.py (same file name as this one: load it by path)
_spec = importlib.util.spec_from_file_location("glue_evaluate", HERE.parent / "glue" / "evaluate.py")
glue_evaluate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(glue_evaluate)
predict, scores, print_scored = glue_evaluate.predict, glue_evaluate.scores, glue_evaluate.print_scored

TASKS = ["IMDB", "SST-2", "SNLI", "QNLI", "QQP", "MNLI"]
DEFAULT_SUBSETS = {"IMDB": ["valid"], "SNLI": ["test"], "MNLI": ["valid", "valid1"]}
METRIC = {"QQP": "avg(acc/f1)", "MNLI": "avg(m/mm)"}


def metric_name(task: str, subsets) -> str:
    """The table's metric of `task` (METRIC, else acc) where `subsets` are the paper's; otherwise the
    metric with the subsets it was computed on (MNLI on matched alone is not avg(m/mm))."""
    metric = "acc" if task == "MNLI" and list(subsets) != DEFAULT_SUBSETS["MNLI"] else METRIC.get(task, "acc")
    return metric if list(subsets) == DEFAULT_SUBSETS.get(task, ["valid"]) else f"{metric} on {'+'.join(subsets)}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=TASKS)
    p.add_argument("--subset", nargs="+", help="default: the paper's (see above)")
    args, model, cfg, task, head, cpu = glue_evaluate.load_classifier(p, argv)
    label_string = glue_evaluate.label_strings(task)

    parts = {}
    subsets = args.subset or DEFAULT_SUBSETS.get(args.task, ["valid"])
    for subset in subsets:
        predictions, targets, examples = predict(model, task, subset, head, False, cpu, args.batch_size,
                                                 args.skip_too_long)
        parts[subset] = scores(args.task, predictions, targets, label_string)  # acc (+ f1 for QQP)
        print_scored(args.task, subset, targets, examples)
        for name, value in parts[subset].items():
            print(f"{args.task} {subset} {name} = {value:.2f}")
        parts[subset].update(examples=len(targets), examples_in_subset=examples)
    if args.task == "QQP":
        value = sum((s["acc"] + s["f1"]) / 2 for s in parts.values()) / len(parts)
    else:  # accuracy; MNLI: mean over matched (valid) and mismatched (valid1)
        value = sum(s["acc"] for s in parts.values()) / len(parts)
    metric = metric_name(args.task, subsets)
    print(f"{args.task} {metric} = {value:.2f}")
    if args.json:
        write_output(args.json, json.dumps({"task": args.task, "metric": metric, "value": value, "parts": parts,
                                            "as_in_table": metric == METRIC.get(args.task, "acc")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
