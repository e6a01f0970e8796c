"""What the classification claims (process50.py, negation_scope.py) share: run fairseq's commands,
train one architecture per entry and seed with `--task sentence_prediction`, score the checkpoint of
the best validation accuracy on the valid and test splits (examples/checkpoint_eval.py: fairseq's
criterion, the number of right answers rather than fairseq-validate's accuracy rounded to 0.1%), and
print one markdown row per entry (the mean and spread over seeds, the paper's number beside it).

An entry is ARCH or ARCH:OPTIONS (extra fairseq-train options of that run). Each run's log is
OUT/ENTRY[_seedN]/train.log; OUT/results.jsonl gets one line per finished run, as it finishes.
"""
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import at_least, markdown_table  # noqa: E402

USER_DIR = REPO / "posenc_fairseq"
CHECKPOINT_EVAL = REPO / "examples" / "checkpoint_eval.py"  # exact counts of right answers
BIN = Path(sys.executable).parent
TRAIN = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr-scheduler", "inverse_sqrt",
         "--warmup-updates", "100", "--dropout", "0.1", "--attention-dropout", "0.1", "--clip-norm", "1.0",
         "--criterion", "sentence_prediction", "--best-checkpoint-metric", "accuracy",
         "--maximize-best-checkpoint-metric", "--no-epoch-checkpoints", "--no-last-checkpoints",
         "--log-format", "simple", "--num-workers", "0"]


def fairseq_command(name: str) -> list:
    """fairseq's console script `name` (fairseq-train ...): beside this Python, else on PATH, else
    its module run by this Python (a machine where fairseq is importable but not installed)."""
    if (BIN / name).exists():
        return [str(BIN / name)]
    if shutil.which(name):
        return [name]
    return [sys.executable, "-m", "fairseq_cli." + name.split("-", 1)[1]]


def run(command, log: Path, env):
    command = [str(part) for part in command]
    if command[0].startswith("fairseq-"):
        command = fairseq_command(command[0]) + command[1:]
    with open(log, "a") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); see {log}:\n" + log.read_text()[-3000:])


def preprocess(raw: Path, data: Path, fields, log: Path, env):
    """fairseq-preprocess of raw/{train,valid,test}.FIELD into data/FIELD, for each field."""
    log.write_text("")
    for field in fields:
        run(["fairseq-preprocess", "--only-source", "--workers", "1", "--destdir", data / field,
             *(option for split in ("train", "valid", "test") for option in (f"--{split}pref", raw / f"{split}.{field}"))],
            log, env)
    return data


def counts_from(text: str, subset: str):
    """(right, examples) that checkpoint_eval.py printed for `subset` (its last line for it), None if none."""
    found = re.findall(rf"^{re.escape(subset)}: (\d+) of (\d+) correct", text, flags=re.M)
    return tuple(int(x) for x in found[-1]) if found else None


def work_folder(out: Path, entry: str, seed: int, seeds) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", entry).strip("_")
    return out / (name if len(seeds) == 1 else f"{name}_seed{seed}")


def train_and_test(entry: str, seed: int, data: Path, work: Path, options: list, args, env) -> dict:
    """Train `entry` with `options` (model, task and budget) and this seed; test its best checkpoint."""
    arch, _, extra = entry.partition(":")
    work.mkdir(parents=True, exist_ok=True)
    log = work / "train.log"
    log.write_text("")
    start = time.time()
    device = [] if args.cuda else ["--cpu"]
    run(["fairseq-train", data, "--user-dir", USER_DIR, "--task", "sentence_prediction", "--arch", arch, *options,
         *TRAIN, *device, "--lr", str(args.lr), "--batch-size", str(args.batch_size), "--max-epoch", str(args.epochs),
         "--seed", str(seed), "--save-dir", work / "checkpoints", *shlex.split(extra)], log, env)
    minutes = (time.time() - start) / 60
    test_log = work / "test.log"
    test_log.write_text("")
    extra_options = shlex.split(extra)
    user_dir = extra_options[extra_options.index("--user-dir") + 1] if "--user-dir" in extra_options else USER_DIR
    # The best checkpoint's right answers counted on valid and test: fairseq-validate and fairseq-train log
    # accuracies rounded to 0.1% only, too coarse for the table's 3 decimals of a fraction and its means
    # over seeds. (Valid in the batches of fairseq-train's validation, so it is the pass that chose the checkpoint.)
    run([sys.executable, CHECKPOINT_EVAL, data, work / "checkpoints" / "checkpoint_best.pt", "--subsets", "valid,test",
         "--batch-size", str(args.batch_size), "--user-dir", user_dir, *device], test_log, env)
    counts = {subset: counts_from(test_log.read_text(), subset) for subset in ("valid", "test")}
    # each validation's accuracy as fairseq-train logged it (0.1% steps): the reach column's epochs only
    curve = [float(x) / 100 for x in re.findall(r"\| valid \|.*?\| accuracy ([0-9.]+)", log.read_text())]
    result = {"entry": entry, "arch": arch, "seed": seed, "valid_curve": curve, "minutes": minutes,
              "device": "cuda" if args.cuda else "cpu", "setup": setup(args)}
    for subset, found in counts.items():
        result[subset] = found[0] / found[1] if found else None
        if found:
            result[f"{subset}_correct"], result[f"{subset}_examples"] = found
    return result


#: what a run's record keeps of the command line: its data and budget (a record read later, e.g. by
#: plot_claims.py, says what it was run with)
SETUP = ("train", "valid", "test", "length", "lag", "repeat", "data_seed", "epochs", "batch_size", "lr")


def setup(args) -> dict:
    return {name: getattr(args, name) for name in SETUP if hasattr(args, name)}


def run_all(out: Path, data: Path, options: list, args, env) -> list:
    """Every entry with every seed, `args.jobs` at a time (each run is its own fairseq process)."""
    results_file = out / "results.jsonl"
    lock = threading.Lock()

    def one(job):
        entry, seed = job
        try:
            result = train_and_test(entry, seed, data, work_folder(out, entry, seed, args.seeds), options, args, env)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            result = {"entry": entry, "arch": entry.partition(":")[0], "seed": seed}
        with lock:
            with open(results_file, "a") as results:
                results.write(json.dumps(result) + "\n")
        print(f"{entry} seed {seed}: test accuracy {result.get('test')}", file=sys.stderr, flush=True)
        return result

    # seed-major: every entry's first seed before any second seed
    jobs = [(entry, seed) for seed in args.seeds for entry in args.arch]
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(one, jobs))


def generate_and_run(args, options: list, write_split) -> list:
    """Write the raw splits with `write_split(folder, split, count, rng)` (one generator seeded with
    --data-seed), binarise them, and run every entry with every seed (`run_all`)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    earlier = [name for name in ("bin", "results.jsonl", "results.md") if (args.out / name).exists()]
    if earlier:  # its data would be drawn anew but not binarised, and its results mixed with these
        raise SystemExit(f"error: {args.out} holds an earlier run ({', '.join(earlier)}): give another --out or "
                         "remove it")
    raw = args.out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.data_seed)
    for split, count in zip(("train", "valid", "test"), (args.train, args.valid, args.test)):
        write_split(raw, split, count, rng)
    data = preprocess(raw, args.out / "bin", ("input0", "label"), args.out / "preprocess.log", env)
    return run_all(args.out, data, options, args, env)


def report(args, results, text: str) -> int:
    """Print the table and keep it in OUT/results.md; the exit status (1 if a run failed)."""
    (args.out / "results.md").write_text(text)
    print(text)
    return 0 if all(result.get("test") is not None for result in results) else 1


def mean_and_spread(values) -> str:
    if not values:
        return "failed"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    each = ", ".join(f"{value:.3f}" for value in values)
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({each})"


def first_epoch_reaching(curve, reach: float):
    return next((epoch for epoch, accuracy in enumerate(curve, start=1) if accuracy >= reach), None)


def of_some(values: list, runs: list) -> str:
    """' (k of n runs)' where a column's mean is over only some of the runs (older records lack it)."""
    return f" ({len(values)} of {len(runs)} runs)" if len(values) < len(runs) else ""


def table(results, heading: str, paper: dict, reach=None) -> str:
    """One row per entry: test accuracy (mean ± sd over seeds, then each seed's), best validation accuracy, the paper's
    number (`paper`: entry -> text), minutes per run, where they ran; with `reach`, also the first epoch whose
    validation accuracy reaches it (mean over the seeds that reached it, how many did)."""
    columns = ["run", "test acc", "best valid acc", "seeds", "paper", "minutes", "device"]
    if reach is not None:
        columns.insert(3, f"first epoch valid ≥ {reach:g}")
    rows = []
    for entry in dict.fromkeys(result["entry"] for result in results):
        runs = [result for result in results if result["entry"] == entry]
        done = [result for result in runs if result.get("test") is not None]
        minutes = [result["minutes"] for result in runs if "minutes" in result]
        valid = [r["valid"] for r in done if r.get("valid") is not None]
        cells = [f"`{entry}`", mean_and_spread([r["test"] for r in done]),
                 (mean_and_spread(valid) + of_some(valid, done)) if valid or not done else "not logged",
                 f"{len(done)}/{len(runs)}", paper.get(entry, ""),
                 f"{statistics.mean(minutes):.1f}{of_some(minutes, runs)}" if minutes else "",
                 ", ".join(sorted({r["device"] for r in runs if "device" in r}))]
        if reach is not None:
            epochs = [epoch for epoch in (first_epoch_reaching(r.get("valid_curve", []), reach) for r in done)
                      if epoch is not None]
            cells.insert(3, f"{statistics.mean(epochs):.1f} ({len(epochs)}/{len(done)})" if epochs else "never")
        rows.append(cells)
    return "\n".join([heading, "", *markdown_table(columns, rows)]) + "\n"


def add_common_args(parser, epochs: int, arch: list):
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--arch", nargs="+", default=arch,
                        help="architectures, each ARCH or ARCH:OPTIONS (extra fairseq-train options of that run)")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per update")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="training seeds (one run per entry and seed)")
    parser.add_argument("--data-seed", type=int, default=1, help="seed of the generated data")
    parser.add_argument("--threads", type=at_least(1), default=1, help="OMP_NUM_THREADS of each command")
    parser.add_argument("--jobs", type=at_least(1), default=1, help="runs at the same time")
    parser.add_argument("--cuda", action="store_true", help="train and test on the GPU (default: --cpu)")
