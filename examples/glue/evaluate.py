#!/usr/bin/env python
"""Score a fine-tuned GLUE checkpoint on the dev set(s) with the task's official metric.

  python examples/glue/evaluate.py TASK DATA_BIN CHECKPOINT [--cpu] [--skip-too-long] [--json out.json]

Runs the model over the binarised dev split(s) of DATA_BIN (valid; for MNLI valid = matched and
valid1 = mismatched), so it works for any BPE. Metrics: CoLA Matthews corr.; MRPC and QQP F1 and
accuracy; STS-B Pearson and Spearman (predictions and gold scaled back by 5); accuracy otherwise.
Prints one `TASK SUBSET METRIC = VALUE` line per metric (percentages, as in the papers' tables).
A dev example longer than the model's max positions is refused with a message, or with
--skip-too-long left out, and then `scored N of M` is printed.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import posenc_fairseq  # noqa: E402,F401
from checkpoint_eval import batches, load_checkpoint  # noqa: E402
from script_helpers import check_output, write_output  # noqa: E402

METRICS = {"CoLA": ["mcc"], "MRPC": ["f1", "acc"], "QQP": ["f1", "acc"], "STS-B": ["pearson", "spearman"]}
SKIP_HELP = "score only the examples that fit the model's max positions (default: refuse if any is longer)"


def predict(model, task, subset, head, regression, cpu, batch_size, skip_too_long=False):
    """(predictions, targets, examples in the subset): fewer predictions than examples only with
    skip_too_long (examples longer than the model's max positions); else those are refused."""
    samples, examples = batches(task, model, subset, batch_size, cpu, skip_too_long)
    predictions, targets = [], []
    with torch.no_grad():
        for sample in samples:
            logits, _ = model(**sample["net_input"], features_only=True, classification_head_name=head)
            if regression:
                predictions += logits.view(-1).float().cpu().tolist()
                targets += sample["target"].view(-1).float().cpu().tolist()
            else:
                predictions += logits.argmax(dim=-1).cpu().tolist()
                targets += sample["target"].view(-1).cpu().tolist()
    return predictions, targets, examples


def classification_head(model, cfg, checkpoint) -> str:
    """The name of the head the checkpoint's criterion trained, refused in one line where the model has
    none (a checkpoint of another task: translation, a language model, RoBERTa before fine-tuning)."""
    head = getattr(cfg.criterion, "classification_head_name", None) or "sentence_classification_head"
    if head not in getattr(model, "classification_heads", {}):
        raise SystemExit(f"error: {checkpoint} has no classification head {head!r} (a {type(model).__name__} "
                         f"of task {getattr(cfg.task, '_name', '?')}): give a checkpoint fine-tuned with "
                         f"sentence_prediction")
    return head


def print_scored(task_name, subset, targets, examples):
    """Where examples were left out (--skip-too-long), say how many the scores are over."""
    if len(targets) != examples:
        print(f"{task_name} {subset}: scored {len(targets)} of {examples} "
              f"(the others are longer than the model's max positions)")


def scores(task_name, predictions, targets, label_string):
    if task_name == "STS-B":
        return {"pearson": 100 * pearsonr(predictions, targets)[0], "spearman": 100 * spearmanr(predictions, targets)[0]}
    result = {"acc": 100 * accuracy_score(targets, predictions)}
    if task_name == "CoLA":
        result["mcc"] = 100 * matthews_corrcoef(targets, predictions)
    if task_name in ("MRPC", "QQP"):
        predicted = [label_string(p) == "1" for p in predictions]
        gold = [label_string(t) == "1" for t in targets]
        result["f1"] = 100 * f1_score(gold, predicted, zero_division=0)
    return result


def load_classifier(parser, argv):
    """The options every scoring script takes (DATA_BIN CHECKPOINT --cpu --batch-size --skip-too-long
    --json) added to `parser` (which has TASK), `argv` parsed and checked, the checkpoint loaded:
    (args, model, cfg, task, head, cpu)."""
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--skip-too-long", action="store_true", help=SKIP_HELP)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not Path(args.data_bin).is_dir():
        parser.error(f"no folder {args.data_bin}")
    if args.json:
        check_output(args.json, [args.data_bin, args.checkpoint], parser.error)
    cpu = args.cpu or not torch.cuda.is_available()
    model, cfg, task = load_checkpoint(args.checkpoint, args.data_bin, cpu)
    return args, model, cfg, task, classification_head(model, cfg, args.checkpoint), cpu


def label_strings(task):
    """index -> its label as the data has it (the index itself where the task has no labels: regression)."""
    labels = getattr(task, "label_dictionary", None)
    return (lambda index: labels.string([index + labels.nspecial])) if labels else str


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=["CoLA", "SST-2", "MRPC", "QQP", "STS-B", "MNLI", "QNLI", "RTE"])
    args, model, cfg, task, head, cpu = load_classifier(p, argv)
    regression = bool(getattr(cfg.task, "regression_target", False))
    subsets = {"MNLI": [("valid", "dev_matched"), ("valid1", "dev_mismatched")]}.get(args.task, [("valid", "dev")])
    label_string = label_strings(task)

    results = {}
    for subset, name in subsets:
        predictions, targets, examples = predict(model, task, subset, head, regression, cpu, args.batch_size,
                                                 args.skip_too_long)
        results[name] = scores(args.task, predictions, targets, label_string)
        results[name].update(examples=len(targets), examples_in_subset=examples)
        print_scored(args.task, name, targets, examples)
        for metric in METRICS.get(args.task, ["acc"]):
            print(f"{args.task} {name} {metric} = {results[name][metric]:.2f}")
    if args.json:
        write_output(args.json, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
