#!/usr/bin/env python
"""How robust is each encoding's Process-50 result to the training set-up? A grid of ordinary settings.

Each axis takes one or more values; the grid is every combination (a cell), and every encoding
trains in every cell with every seed (process50.py's task and model, runner.py's commands):

    python examples/claims/sweep.py --out work/sweep --lr 2e-4 5e-4 1e-3 --betas 0.9,0.98 0.9,0.999 \
        --seeds 1 2 3 --jobs 2 --keep docs/data/process50_sweep.jsonl

An axis left out keeps runner.py's setting (the first value listed below); `--issue-grid` takes every
value below on every axis (192 cells, 768 runs per seed: spread them over several runs with `--shard I/K`).

    --lr         2e-4 5e-4 1e-3            --betas      0.9,0.98 0.9,0.999 (fairseq's default)
    --schedule   inverse_sqrt polynomial_decay (linear to 0 at the last update; both warm up 100 updates)
    --batch      64 32                     --clip       1.0 0 (0: no --clip-norm)
    --ffn        256 128 (d 64, 2 layers)  --dropout    0.1 0 (--dropout and --attention-dropout)
    --data-seeds 1 (each a fresh draw of the data)

A run counts as leaving the plateau when its test accuracy reaches SUCCESS (0.75; chance is 0.5,
the Bayes rate 0.839). Every run is one JSON line in OUT/results.jsonl and, with `--keep`, in that
file too (appended as it finishes; a failed run with test null); a run finished in either (the same
encoding, cell, seed, device and budget) is not run again, so an interrupted or sharded sweep resumes and
a failed run is retried. A run that failed and never finished is counted apart in the table ("1 failed"),
not in its rates, and makes the exit status 1. The encoding is
recorded as given: when a default of its options changes, relabel the runs recorded before (their
`arch` naming the options they ran with, `ran_as` what they were given), or they count as the new default's. The table
gives per cell and encoding the fraction of runs that left the plateau and their mean test accuracy,
and marks the cells where T5 left it in more runs than AT5 did, or AT5's mean is more than 0.01 below
T5's (`decides`).
"""
import argparse
import copy
import fcntl
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import process50  # noqa: E402
from posenc_fairseq.provenance import source_commit  # noqa: E402
from runner import preprocess, train_and_test  # noqa: E402
from script_helpers import at_least, markdown_table  # noqa: E402  (examples/, on the path through runner)

SUCCESS = 0.75  # test accuracy from which a run has left the plateau (chance 0.5)
ENCODINGS = ["roberta_at5", "roberta_at5_nob", "roberta_t5", "roberta_nope"]
#: every axis with runner.py's setting first, then the issue's other values (`--issue-grid`)
AXES = {"lr": [1e-3, 5e-4, 2e-4], "betas": ["0.9,0.98", "0.9,0.999"],
        "schedule": ["inverse_sqrt", "polynomial_decay"], "batch": [64, 32], "clip": [1.0, 0.0],
        "ffn": [256, 128], "dropout": [0.1, 0.0], "data_seed": [1]}
WARMUP = 100


class Cell(NamedTuple):
    """One training set-up (everything but the encoding and the seed)."""
    lr: float
    betas: str
    schedule: str
    batch: int
    clip: float
    ffn: int
    dropout: float
    data_seed: int


def cells(axes: Dict[str, list]) -> List[Cell]:
    return [Cell(*values) for values in itertools.product(*(axes[name] for name in Cell._fields))]


def shard(items: list, which: str) -> list:
    """Part I of K (`which` = "I/K", I from 0) of `items`, every K-th from the I-th."""
    index, count = (int(part) for part in which.split("/"))
    if not 0 <= index < count:
        raise SystemExit(f"--shard {which}: expected I/K with 0 <= I < K")
    return items[index::count]


def updates(cell: Cell, args) -> int:
    return args.epochs * math.ceil(args.train / cell.batch)


def fairseq_options(cell: Cell, args) -> List[str]:
    """What the cell sets in runner.py's fairseq-train command (its --lr and --batch-size aside)."""
    options = ["--adam-betas", f"({cell.betas})", "--clip-norm", f"{cell.clip:g}",
               "--encoder-ffn-embed-dim", str(cell.ffn), "--dropout", f"{cell.dropout:g}",
               "--attention-dropout", f"{cell.dropout:g}", "--lr-scheduler", cell.schedule,
               "--warmup-updates", str(WARMUP)]
    if cell.schedule == "polynomial_decay":
        options += ["--total-num-update", str(updates(cell, args)), "--end-learning-rate", "0"]
    return options


def cell_folder(cell: Cell) -> str:
    """The folder of a cell's runs, named by its settings (not its place in one sweep's grid, which
    another sweep with other axes would give to other settings)."""
    return "cell_" + "_".join(f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}"
                              for name, value in cell._asdict().items()).replace(",", "-")


def work_folder(encoding: str, seed: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", encoding).strip("_") + f"_seed{seed}"


def run_key(record: dict) -> tuple:
    """What makes two runs the same run (a recorded one is not run again)."""
    return (record["arch"], tuple(record["cell"][name] for name in Cell._fields), record["seed"], record["device"],
            record["epochs"], tuple(record["sizes"]))


def recorded(*files: Path, failed: bool = False) -> dict:
    """The finished runs (a test accuracy) kept in `files` (None or missing: none), by `run_key`; with
    `failed`, also each run that failed and never finished (its last record, test None)."""
    runs, failures = {}, {}
    for file in files:
        if file is not None and file.exists():
            for line in file.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    (runs if record.get("test") is not None else failures)[run_key(record)] = record
    if failed:
        runs.update((key, record) for key, record in failures.items() if key not in runs)
    return runs


def data_for(out: Path, data_seed: int, args, env) -> Path:
    """Process-50 drawn with `data_seed` at the sizes asked for (the folder names both, so a sweep with
    other --train/--valid/--test never reads another's data), binarised once per sweep folder: under a
    lock on the folder (several sweeps may share it), into a temporary folder renamed to `bin` when
    complete, so that an interrupted binarisation is redone rather than read half-written."""
    folder = out / f"data_seed{data_seed}_{args.train}-{args.valid}-{args.test}"
    data = folder / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not data.exists():
            raw = folder / "raw"
            raw.mkdir(exist_ok=True)
            rng = random.Random(data_seed)
            for split, count in zip(("train", "valid", "test"), (args.train, args.valid, args.test)):
                process50.write_split(raw, split, count, rng)
            partial = Path(tempfile.mkdtemp(prefix="bin.partial.", dir=folder))
            try:
                preprocess(raw, partial, ("input0", "label"), folder / "preprocess.log", env)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            partial.rename(data)
    return data


def sweep(args) -> List[dict]:
    """Every (cell, encoding, seed) not recorded yet, `args.jobs` at a time; the records of this sweep's
    grid (found or made)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    device = "cuda" if args.cuda else "cpu"
    sizes = [args.train, args.valid, args.test]
    grid = shard(cells(args.axes), args.shard)
    done = recorded(args.out / "results.jsonl", args.keep)
    jobs = [(cell, arch, seed) for seed in args.seeds for cell in grid for arch in args.encodings]
    base = {"device": device, "epochs": args.epochs, "sizes": sizes}
    todo = [job for job in jobs
            if run_key({**base, "arch": job[1], "cell": job[0]._asdict(), "seed": job[2]}) not in done]
    print(f"{len(grid)} cells x {len(args.encodings)} encodings x {len(args.seeds)} seeds: "
          f"{len(jobs) - len(todo)} recorded, {len(todo)} to run", file=sys.stderr, flush=True)
    data = {seed: data_for(args.out, seed, args, env) for seed in sorted({cell.data_seed for cell in grid})}
    lock = threading.Lock()

    def one(job):
        cell, arch, seed = job
        run_args = copy.copy(args)
        run_args.lr, run_args.batch_size = cell.lr, cell.batch
        work = args.out / cell_folder(cell) / work_folder(arch, seed)
        model, _, extra = arch.partition(":")  # an encoding ARCH:OPTIONS: its own options after the cell's
        try:
            # the cell's options as the run's extra options: given after runner.py's settings, they win
            result = train_and_test(f"{model}:{shlex.join(fairseq_options(cell, args))} {extra}", seed,
                                    data[cell.data_seed], work, process50.MODEL, run_args, env)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            result = {"arch": arch, "seed": seed, "test": None}
        record = {**base, "arch": arch, "cell": cell._asdict(), "seed": seed, "test": result.get("test"),
                  "valid": result.get("valid"), "minutes": result.get("minutes"), "commit": args.commit}
        with lock:
            for file in (args.out / "results.jsonl", args.keep):
                if file is not None:
                    with open(file, "a") as out:
                        out.write(json.dumps(record) + "\n")
        print(f"{work.parent.name} {arch} seed {seed}: test accuracy {record['test']}", file=sys.stderr, flush=True)
        return record

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))
    wanted = {run_key({**base, "arch": arch, "cell": cell._asdict(), "seed": seed}) for cell, arch, seed in jobs}
    return [record for key, record in recorded(args.keep, args.out / "results.jsonl", failed=True).items()
            if key in wanted]


def summary(records: List[dict]) -> Dict[tuple, Dict[str, dict]]:
    """Per cell (its settings as a tuple) and encoding: the finished runs, the fraction of them that left
    the plateau (test accuracy >= SUCCESS) and their mean test accuracy (None without one), and the runs
    that failed (test None: they say nothing about the plateau, so they are counted apart)."""
    table: Dict[tuple, Dict[str, list]] = {}
    for record in records:
        cell = tuple(record["cell"][name] for name in Cell._fields)
        table.setdefault(cell, {}).setdefault(record["arch"], []).append(record["test"])

    def counts(tests):
        done = [test for test in tests if test is not None]
        return {"runs": len(done), "failed": len(tests) - len(done),
                "rate": sum(test >= SUCCESS for test in done) / len(done) if done else None,
                "mean": statistics.mean(done) if done else None}

    return {cell: {arch: counts(tests) for arch, tests in by_arch.items()} for cell, by_arch in table.items()}


def decides(by_arch: Dict[str, dict]) -> bool:
    """Whether AT5 falls short of T5 in the cell: left the plateau in fewer runs, or a mean more than
    0.01 below."""
    at5, t5 = by_arch.get("roberta_at5"), by_arch.get("roberta_t5")
    if at5 is None or t5 is None or not at5["runs"] or not t5["runs"]:
        return False
    return at5["rate"] < t5["rate"] or at5["mean"] < t5["mean"] - 0.01


def markdown(records: List[dict], encodings: List[str]) -> str:
    columns = [*Cell._fields, *encodings, "AT5 < T5"]
    heading = (f"Process-50 sweep: per cell and encoding, runs leaving the plateau (test accuracy >= {SUCCESS:g}) / "
               "runs, and the mean test accuracy; runs that failed are counted apart")

    def mark(counts):
        finished = (f"{round(counts['rate'] * counts['runs'])}/{counts['runs']} ({counts['mean']:.3f})"
                    if counts["runs"] else "")
        return ", ".join(filter(None, [finished, f"{counts['failed']} failed" if counts["failed"] else ""]))

    rows = [[*(f"{value:g}" if isinstance(value, float) else value for value in cell),
             *(mark(by_arch[arch]) if arch in by_arch else "" for arch in encodings), "yes" if decides(by_arch) else ""]
            for cell, by_arch in sorted(summary(records).items())]
    return "\n".join([heading, "", *markdown_table(columns, rows)]) + "\n"


def cell_label(cell: tuple) -> str:
    """A cell's settings in a few characters, for the plot's rows."""
    lr, betas, schedule, batch, clip, ffn, dropout, data_seed = cell
    return (f"lr {lr:g}, b2 {betas.split(',')[1]}, {'isqrt' if schedule == 'inverse_sqrt' else 'poly'}, "
            f"batch {batch}, clip {clip:g}, ffn {ffn}, drop {dropout:g}, data {data_seed}")


def plot(records: List[dict], encodings: List[str], path: Path):
    """Per cell (a row), each encoding's fraction of runs that left the plateau (a bar, its run count
    written beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = sorted(summary(records).items())
    height = 0.8 / len(encodings)
    fig, ax = plt.subplots(figsize=(8, 0.25 * len(table) * len(encodings) + 1.8))
    for index, arch in enumerate(encodings):
        rows = [(row, by_arch[arch]) for row, (_, by_arch) in enumerate(table) if by_arch.get(arch, {}).get("runs")]
        ys = [row + (index - (len(encodings) - 1) / 2) * height for row, _ in rows]
        ax.barh(ys, [cell["rate"] for _, cell in rows], height, label=arch)
        for y, (_, cell) in zip(ys, rows):
            failed = f", {cell['failed']} failed" if cell["failed"] else ""
            ax.text(cell["rate"] + 0.01, y, f"{cell['runs']} runs, mean {cell['mean']:.3f}{failed}", va="center",
                    fontsize=6)
    ax.set_yticks(range(len(table)), [cell_label(cell) for cell, _ in table], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.45)
    ax.set_xlabel(f"fraction of runs leaving the plateau (test accuracy >= {SUCCESS:g})", fontsize=8)
    ax.set_title("Process-50 sweep: robustness per training set-up", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (the long row labels: the figure grows to fit them)
    plt.close(fig)


def add_grid_args(parser):
    """The options that say what one run trains on and how (the cell's axes, the data's sizes, the
    budget, the threads), shared with at5_dynamics.py, which traces one run."""
    parser.add_argument("--out", type=Path, required=True, help="sweep folder (data, runs, results.jsonl, results.md)")
    parser.add_argument("--issue-grid", action="store_true", help="every value listed above on every axis")
    parser.add_argument("--lr", type=float, nargs="+")
    parser.add_argument("--betas", nargs="+", help="Adam's betas as B1,B2")
    parser.add_argument("--schedule", nargs="+", choices=AXES["schedule"])
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--clip", type=float, nargs="+", help="--clip-norm (0: none)")
    parser.add_argument("--ffn", type=int, nargs="+")
    parser.add_argument("--dropout", type=float, nargs="+")
    parser.add_argument("--data-seeds", dest="data_seed", type=int, nargs="+")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--train", type=int, default=5000)
    parser.add_argument("--valid", type=int, default=1000)
    parser.add_argument("--test", type=int, default=5000)
    parser.add_argument("--threads", type=at_least(1), default=1, help="OMP_NUM_THREADS of each command")


def grid_axes(args, parser) -> Dict[str, list]:
    """Each axis's values: those given, else runner.py's setting (every listed value with --issue-grid)."""
    axes = {name: (values if args.issue_grid else values[:1]) if getattr(args, name) is None else getattr(args, name)
            for name, values in AXES.items()}
    for betas in axes["betas"]:
        if len(betas.split(",")) != 2:
            parser.error(f"--betas {betas}: expected B1,B2")
    return axes


def parse(argv=None):
    """The sweep's options; `axes`: each axis's values."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_args(parser)
    parser.add_argument("--keep", type=Path, help="also append every finished run here (e.g. docs/data/process50_sweep.jsonl)")
    parser.add_argument("--encodings", nargs="+", default=ENCODINGS,
                        help="architectures, each ARCH or ARCH:OPTIONS (its own fairseq-train options, after the cell's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--shard", default="0/1", help="I/K: run every K-th cell from the I-th")
    parser.add_argument("--jobs", type=at_least(1), default=1, help="runs at the same time")
    parser.add_argument("--cuda", action="store_true", help="train and test on the GPU (default: --cpu)")
    parser.add_argument("--commit", default=None,
                        help="recorded with each run (default: this tree's commit, -dirty where files differ)")
    args = parser.parse_args(argv)
    if args.commit is None:
        args.commit = source_commit() or ""
    args.axes = grid_axes(args, parser)
    return args


def main(argv=None):
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records = sweep(args)
    text = markdown(records, args.encodings)
    (args.out / "results.md").write_text(text)
    print(text)
    expected = len(args.seeds) * len(args.encodings) * len(shard(cells(args.axes), args.shard))
    return 0 if len(records) == expected and all(record["test"] is not None for record in records) else 1


if __name__ == "__main__":
    sys.exit(main())
