#!/usr/bin/env python
"""Why does a Process-50 run stay on the plateau? One run of sweep.py's, traced update by update.

    python examples/claims/at5_dynamics.py --out work/dynamics --arch roberta_at5 --seed 3 [sweep.py's axes]
    python examples/claims/at5_dynamics.py --out work/dynamics --arch "roberta_at5:--at5-gamma-init uniform" ...

trains one encoding on Process-50 exactly as a sweep cell does (the same fairseq options, built by
sweep.py, run by fairseq's own Trainer in this process instead of fairseq-train; ARCH:OPTIONS as in
sweep.py's --encodings, the encoding's own options after the cell's), and records every
`--every` updates, per group of parameters, the gradient norm (after fairseq's clipping: what the
optimizer was given), the norm of the update the optimizer made, and the parameters' norm:

    gamma        AT5's raw gammas (gamma = exp(8 raw))       mlp.w1 .. mlp.b3   AT5's MLP layers
    table        T5's per-bucket table                       attention          q/k/v/out projections
    other        the rest (embeddings, FFNs, norms, head)

and once per epoch the validation accuracy and, per head, the bias e_h(d) over the distances
d = -3..3 of the first layer's table (its spread over d = 0..3 on each side is what Process-50
needs: neighbours against the rest). Output: OUT/ARCH_seedN.jsonl (one line per record; named
ARCH_seedN.jsonl.partial while the run lasts, so a stopped run's trace is not taken for a whole one) and a
summary of the first and last epochs' mean gradient and update sizes per group. It takes
sweep.py's options of one run (its axes, one value each, sizes, epochs, threads) and trains on the CPU.
"""
import argparse
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import process50  # noqa: E402
import sweep  # noqa: E402
from runner import TRAIN, USER_DIR  # noqa: E402
from script_helpers import markdown_table  # noqa: E402  (examples/, on the path through runner)

GROUPS = [("gamma", r"raw_gammas\."), ("mlp.{}", r"mlps\.[^.]+\.(\w+?)_raw$"), ("table", r"\.tables\."),
          ("attention", r"\.(q|k|v|out)_proj\.")]


def group_of(name: str) -> str:
    for label, pattern in GROUPS:
        found = re.search(pattern, name)
        if found:
            return label.format(*found.groups())
    return "other"


def build(args, data: Path):
    """fairseq's trainer and epoch iterator, set up as fairseq_cli.train.main sets them up."""
    from fairseq import checkpoint_utils, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer
    import numpy

    arch, _, extra = args.arch.partition(":")
    argv = [str(data), "--user-dir", str(USER_DIR), "--task", "sentence_prediction", "--arch", arch,
            *process50.MODEL, *TRAIN, "--cpu", "--lr", str(args.cell.lr), "--batch-size", str(args.cell.batch),
            "--max-epoch", str(args.epochs), "--seed", str(args.seed), "--save-dir", str(args.out / "checkpoints"),
            "--no-save", *sweep.fairseq_options(args.cell, args), *shlex.split(extra)]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    utils.import_user_module(cfg.common)
    numpy.random.seed(cfg.common.seed)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("valid", combine=False, epoch=1)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    _, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
    return trainer, epoch_itr


def sizes(model, before: dict) -> dict:
    """Per group: gradient norm, update norm (against `before`), parameter norm."""
    squares = {}
    for name, parameter in model.named_parameters():
        group = squares.setdefault(group_of(name), [0.0, 0.0, 0.0])
        if parameter.grad is not None:
            group[0] += float(parameter.grad.float().pow(2).sum())
        group[1] += float((parameter.detach() - before[name]).float().pow(2).sum())
        group[2] += float(parameter.detach().float().pow(2).sum())
    return {group: {"grad": math.sqrt(g), "update": math.sqrt(u), "norm": math.sqrt(p)}
            for group, (g, u, p) in squares.items()}


def bias_by_distance(model) -> list:
    """(heads, 7) bias of the first table at d = -3..3 (key - query), or [] without a scalar bias."""
    encoding = getattr(model, "positional_encoding", None)
    if encoding is None or not hasattr(encoding, "distance_bias"):
        return []
    with torch.no_grad():
        return encoding.distance_bias(encoding.table_keys()[0], -3, 3).float().tolist()


def spread(bias: list) -> list:
    """Per head: max - min of e_h(d) over d = 0..3 on each side, the larger of the two."""
    return [max(max(row[3:]) - min(row[3:]), max(row[:4]) - min(row[:4])) for row in bias]


def validate(trainer) -> dict:
    """Validation accuracy and loss (in bits per sentence, as fairseq logs it)."""
    model, criterion = trainer.model, trainer.criterion
    itr = trainer.get_valid_iterator("valid").next_epoch_itr(shuffle=False)
    correct = total = loss = 0.0
    model.eval()
    with torch.no_grad():
        for sample in itr:
            _, _, logged = criterion(model, sample)
            correct, total = correct + int(logged["ncorrect"]), total + int(logged["nsentences"])
            loss += float(logged["loss"])
    model.train()
    return {"valid": correct / total, "valid_loss": loss / total / math.log(2)}


def trace(args) -> list:
    from fairseq.data import iterators

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    data = sweep.data_for(args.out, args.cell.data_seed, args, env)
    torch.set_num_threads(args.threads)
    trainer, epoch_itr = build(args, data)
    model, records = trainer.model, []
    path = args.out / f"{sweep.work_folder(args.arch, args.seed)}.jsonl"
    partial = path.with_name(path.name + ".partial")  # the trace so far: a stopped run's is never taken as whole
    with open(partial, "w") as out:
        def keep(record):
            records.append(record)
            out.write(json.dumps(record) + "\n")
            out.flush()

        keep({"epoch": 0, **validate(trainer), "bias": bias_by_distance(model)})
        while epoch_itr.next_epoch_idx <= args.epochs:
            itr = iterators.GroupedIterator(epoch_itr.next_epoch_itr(shuffle=True), 1)
            trainer.begin_epoch(epoch_itr.epoch)
            for samples in itr:
                before = {name: p.detach().clone() for name, p in model.named_parameters()}
                logged = trainer.train_step(samples)
                update = trainer.get_num_updates()
                if update % args.every == 0:
                    keep({"epoch": epoch_itr.epoch, "update": update, "lr": trainer.get_lr(),
                          "loss": float(logged["loss"]) if logged and "loss" in logged else None,
                          "groups": sizes(model, before)})
            valid = validate(trainer)
            trainer.lr_step(epoch_itr.epoch, None)
            bias = bias_by_distance(model)
            keep({"epoch": epoch_itr.epoch, **valid, "bias": bias, "spread": spread(bias) if bias else []})
            print(f"{args.arch} seed {args.seed} epoch {epoch_itr.epoch}: valid {valid['valid']:.3f}", file=sys.stderr,
                  flush=True)
            epoch_itr = trainer.get_train_iterator(epoch_itr.next_epoch_idx, load_dataset=False)
    os.replace(partial, path)
    return records


def summary(records: list) -> str:
    """Mean gradient and update norms per group over the first and the last epoch traced."""
    steps = [r for r in records if "groups" in r]
    epochs = sorted({r["epoch"] for r in steps})
    header = ["group", *(f"epoch {e} {norm}" for e in (epochs[0], epochs[-1]) for norm in ("grad", "update"))]
    rows = []
    for group in sorted(steps[0]["groups"]):
        cells = [group]
        for epoch in (epochs[0], epochs[-1]):
            chosen = [r["groups"][group] for r in steps if r["epoch"] == epoch]
            cells += [f"{sum(c['grad'] for c in chosen) / len(chosen):.3g}",
                      f"{sum(c['update'] for c in chosen) / len(chosen):.3g}"]
        rows.append(cells)
    lines = markdown_table(header, rows)
    valid = [r for r in records if "valid" in r]
    accuracies = ", ".join(f"{r['valid']:.3f}" for r in valid)
    lines.append(f"\nvalidation accuracy by epoch: {accuracies}")
    if valid[-1].get("spread"):
        lines.append("bias spread over d = 0..3 per head, first / last epoch: "
                     f"{[round(s, 4) for s in valid[1]['spread']]} / {[round(s, 4) for s in valid[-1]['spread']]}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_grid_args(parser)
    parser.add_argument("--arch", default="roberta_at5",
                        help="ARCH or ARCH:OPTIONS (its own fairseq-train options, after the cell's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--every", type=int, default=10, help="record every N updates")
    args = parser.parse_args(argv)
    args.axes = sweep.grid_axes(args, parser)
    if any(len(values) > 1 for values in args.axes.values()):
        parser.error("one value per axis: this traces one cell")
    args.cell = sweep.cells(args.axes)[0]
    args.out.mkdir(parents=True, exist_ok=True)
    print(summary(trace(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
