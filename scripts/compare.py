#!/usr/bin/env python
"""Train several architectures on one binarised data set with the same settings and compare them
in one markdown table and one plot.

    python scripts/compare.py DATA-BIN --arch ARCH [ARCH ...] --out DIR [options] -- FAIRSEQ-TRAIN-OPTIONS

Every architecture is trained in turn with `fairseq-train DATA-BIN --user-dir posenc_fairseq
--arch ARCH FAIRSEQ-TRAIN-OPTIONS --save-dir DIR/ARCH/checkpoints` (the options after `--` are the
same for all and must stop training: --max-update or --max-epoch), then its last checkpoint is
evaluated on --subset according to the task stored in it:

- translation: BLEU (sacrebleu) of `fairseq-generate --scoring sacrebleu` (--generate-args are
  passed on, e.g. `--bpe sentencepiece --sentencepiece-model M`), and with --length-bins the BLEU
  of each source-length bin;
- sentence_prediction (any task whose criterion logs an accuracy): accuracy (%) from `fairseq-validate`;
- masked_lm / language_modeling (and anything else): perplexity from `fairseq-validate`, or its loss
  where the criterion logs no perplexity (e.g. sentence_prediction with --regression-target).

Writes DIR/results.md (the table, also printed, under a line with the commit and the command line
that made it), DIR/results.csv (the same in the columns `commit`, `command`, `train_options`,
`generate_args`) and DIR/compare.png; each architecture's logs are in DIR/ARCH/. A rerun into the same
DIR replaces DIR/ARCH: an earlier run's DIR/ARCH/checkpoints are removed before ARCH trains (DATA-BIN
must not lie there). An architecture that fails (a command, or reading its results:
DIR/ARCH/error.log) is reported in the table and named over the plot, the others still run, and the
exit status is then 1. `--preset demo` adds the demo's model and training settings
(examples/demo/run_demo.py) for the toy data `make demo` prepares in work/demo/data/.
"""
import argparse
import csv
import importlib.util
import io
import os
import re
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "posenc_fairseq"
sys.path.insert(0, str(REPO))  # this tree's posenc_fairseq: the one fairseq-train gets as --user-dir
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import increasing_counts, markdown_table, write_output  # noqa: E402

from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from posenc_fairseq.provenance import source_commit  # noqa: E402

#: --length-bins B1,B2,...: the upper edges of the source-length bins in words
length_bins = increasing_counts(1, "word counts")


def demo_module():
    spec = importlib.util.spec_from_file_location("run_demo", REPO / "examples" / "demo" / "run_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEMO = demo_module()  # its runner (live progress lines, full log) and the demo's settings


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_options = []
    if "--" in argv:
        split = argv.index("--")
        argv, train_options = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s DATA-BIN --arch ARCH [ARCH ...] --out DIR [options] -- "
                                           "FAIRSEQ-TRAIN-OPTIONS")
    parser.add_argument("data", type=Path, help="binarised data (fairseq-preprocess output)")
    parser.add_argument("--arch", nargs="+", required=True, help="architectures to train and compare")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--subset", help="evaluation subset (default: test for translation, valid otherwise)")
    parser.add_argument("--length-bins", type=length_bins, metavar="B1,B2,...",
                        help="translation: also BLEU per source length (words) bin: 0..B1, B1+1..B2, ..., >Bn")
    parser.add_argument("--generate-args", default="", help="extra fairseq-generate options (one string; with "
                        "--preset demo, after the demo's)")
    parser.add_argument("--preset", choices=("demo",), help="add the demo's model/training settings")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each command (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no fairseq progress lines")
    args = parser.parse_args(argv)
    args.train_options = train_options
    if args.preset == "demo":
        args.train_options = DEMO.TRAIN_OPTIONS + ["--log-interval", "50"] + train_options
        spm = args.data.parent / "spm" / "spm.model"
        # the demo's (sentencepiece removed, translations at most 20 pieces longer), then the user's
        # (later options win)
        args.generate_args = ("--max-len-a 1 --max-len-b 20" + (
            f" --bpe sentencepiece --sentencepiece-model {spm}" if spm.exists() else "") + " " + args.generate_args).strip()
    ends = [value for option in ("--max-update", "--max-epoch") for value in values_of(option, args.train_options)]
    if not any(value.strip().isdigit() and int(value) > 0 for value in ends):  # (fairseq reads 0 as no limit)
        parser.error("give the training length after `--`: --max-update N or --max-epoch N (N > 0)")
    DEMO.refuse_unusable_device(parser, args)
    if not args.data.is_dir():
        parser.error(f"no data folder {args.data}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder")
    for arch in args.arch:  # (each run removes DIR/ARCH/checkpoints first)
        removed = (args.out / arch / "checkpoints").resolve()
        if args.data.resolve().is_relative_to(removed):
            parser.error(f"DATA-BIN {args.data} lies in {args.out / arch / 'checkpoints'}, which a run removes: "
                         "give another --out")
    import posenc_fairseq  # noqa: F401  (registers this package's architectures beside fairseq's)
    from fairseq.models import ARCH_MODEL_REGISTRY

    unknown = [arch for arch in args.arch if arch not in ARCH_MODEL_REGISTRY]
    if unknown:  # before the first architecture trains, not after it
        parser.error(f"unknown architecture {', '.join(unknown)} (neither fairseq's nor posenc_fairseq's)")
    for option in ("--save-dir", "--arch", "--user-dir", "--cpu"):
        if given(option, args.train_options):
            parser.error(f"{option} is set by compare.py (use --out / --arch / --device)")
    return args


#: fairseq's short aliases of options compare.py sets itself
SHORT_ALIASES = {"--arch": "-a"}


def names(option: str, part: str) -> bool:
    """Whether the command-line word `part` names `option` as fairseq-train reads it: `--option`,
    `--option=VALUE`, an abbreviation (argparse takes an unambiguous prefix, e.g. `--ar`) or its
    short alias (`-a`)."""
    name = part.split("=", 1)[0]
    return name == SHORT_ALIASES.get(option) or (name.startswith("--") and len(name) > 2 and option.startswith(name))


def given(option: str, options: list) -> bool:
    """Whether `options` give `option` (`names`)."""
    return any(names(option, part) for part in options)


def values_of(option: str, options: list) -> list:
    """The values `options` give `option` (`--option VALUE` or `--option=VALUE`), in order."""
    return [part.split("=", 1)[1] if "=" in part else (options[index + 1] if index + 1 < len(options) else "")
            for index, part in enumerate(options) if names(option, part)]


def stored_task(checkpoint: Path):
    """(task, criterion) names the checkpoint was trained with."""
    import torch

    import posenc_fairseq  # noqa: F401  (safe globals for fairseq checkpoints)

    state = torch.load(checkpoint, map_location="cpu")
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("task") is not None:
        names = [cfg[part].get("_name") if cfg.get(part) is not None else None for part in ("task", "criterion")]
        return names[0] or "translation", names[1]
    args = state.get("args")
    return getattr(args, "task", "translation"), getattr(args, "criterion", None)


def words_in(source: str) -> int:
    """The words of a source line as fairseq-generate prints it (S-i): the data's tokens, which may be
    sentencepiece pieces (a word starts at each piece with U+2581) or subword-nmt's (`@@ ` joins)."""
    if "\u2581" in source:
        return sum(piece.startswith("\u2581") for piece in source.split())
    return len(source.replace("@@ ", "").split())


def bleu_by_length(generate_output: str, bins):
    """[(label, BLEU, sentences)] per source-length bin from fairseq-generate's S/T/D lines: 0..B1
    words, B1+1..B2, ..., more than Bn, so that every sentence is in one bin (an empty source too).
    With --nbest N the first (best) hypothesis of each sentence is scored."""
    import sacrebleu

    source, reference, hypothesis = {}, {}, {}
    for line in generate_output.split("\n"):  # only fairseq's line ends (a sentence may hold U+2028)
        found = re.match(r"^([STD])-(\d+)\t(.*)$", line)
        if not found:
            continue
        kind, index, text = found.groups()
        if kind == "D":
            text = text.split("\t", 1)[1] if "\t" in text else ""  # D-i <score> <detokenized>
        {"S": source, "T": reference, "D": hypothesis}[kind].setdefault(int(index), text)
    edges = [0] + sorted(bins) + [float("inf")]
    lengths = {i: words_in(source.get(i, "")) for i in hypothesis if i in reference}
    result = []
    for number, (low, high) in enumerate(zip(edges[:-1], edges[1:])):
        above = low - 1 if number == 0 else low  # the first bin holds its low edge (0 words), the rest start above
        ids = [i for i, length in lengths.items() if above < length <= high]
        label = f"{above + 1}-{high}" if high != float("inf") else f">{low}"
        score = sacrebleu.corpus_bleu([hypothesis[i] for i in ids], [[reference[i] for i in ids]]).score if ids else None
        result.append((label, score, len(ids)))
    return result


def evaluate(args, arch, work, checkpoint, env, device):
    """{'metric': name, 'value': float, 'bins': [...]} for one trained architecture."""
    task, criterion = stored_task(checkpoint)
    if task == "translation":
        subset = args.subset or "test"
        output = work / "generate.txt"
        output.write_text("")
        DEMO.run(DEMO.command_line(
            "fairseq-generate", args.data, "--user-dir", USER_DIR, "--path", checkpoint, "--gen-subset", subset,
            "--beam", "4", "--batch-size", "64", "--scoring", "sacrebleu", *shlex.split(args.generate_args),
            *device), output, show=None if args.quiet else DEMO.generate_progress, env=env)
        text = output.read_text()
        scores = re.findall(r"BLEU = ([0-9.]+)", text)
        if not scores:
            raise DEMO.CommandFailed(f"no BLEU in {output}")
        bins = bleu_by_length(text, args.length_bins) if args.length_bins else []
        return {"metric": f"BLEU ({subset})", "value": float(scores[-1]), "bins": bins}
    subset = args.subset or "valid"
    output = work / "validate.log"
    output.write_text("")
    DEMO.run(DEMO.command_line(
        "fairseq-validate", args.data, "--user-dir", USER_DIR, "--path", checkpoint, "--task", task,
        *(["--criterion", criterion] if criterion else []), "--valid-subset", subset, "--max-tokens", "4096",
        *device), output, env=env)
    text = output.read_text()
    line = [line for line in text.splitlines() if f"valid on '{subset}' subset" in line]
    if not line:
        raise DEMO.CommandFailed(f"no validation result in {output}")
    fields = dict(re.findall(r"\| (\w+) ([0-9.e+-]+|inf|nan)", line[-1]))
    # accuracy for a classifier, perplexity for a language model; the loss where neither is logged
    # (sentence_prediction with --regression-target logs its mean squared error as loss)
    for field, metric in (("accuracy", "accuracy %"), ("ppl", "perplexity"), ("loss", "loss")):
        if field in fields:
            return {"metric": f"{metric} ({subset})", "value": float(fields[field]), "bins": []}
    raise DEMO.CommandFailed(f"no accuracy, ppl or loss in the validation result of {output}")


def train_and_evaluate(args, arch, env, device):
    work = args.out / arch
    if (work / "checkpoints").exists():  # a fresh run, the same for every architecture
        print(f"{arch}: removing an earlier run's checkpoints in {work / 'checkpoints'}", flush=True)
        shutil.rmtree(work / "checkpoints")
    work.mkdir(parents=True, exist_ok=True)
    log = work / "train.log"
    log.write_text("")
    started = time.time()
    extra = DEMO.arch_options(arch) if args.preset == "demo" else []
    DEMO.run(DEMO.command_line(
        "fairseq-train", args.data, "--user-dir", USER_DIR, "--arch", arch, *extra, *args.train_options,
        "--save-dir", work / "checkpoints", *device), log, show=None if args.quiet else DEMO.train_progress, env=env)
    seconds = time.time() - started
    text = log.read_text()
    params = re.search(r"num\. (?:shared )?model params: ([0-9,]+)", text)
    result = evaluate(args, arch, work, work / "checkpoints" / "checkpoint_last.pt", env, device)
    result.update(arch=arch, params=int(params.group(1).replace(",", "")) if params else None,
                  train_seconds=seconds, valid_loss=last_valid_loss(text))
    return result


def last_valid_loss(train_log: str):
    """The validation loss fairseq-train logged after its last update (the model the metric scores),
    or None where it did not validate then (--validate-interval N stopping on an epoch not a multiple
    of N): an earlier validation is another model's."""
    final = re.findall(r"\| train \|.*?\| num_updates (\d+)", train_log)
    for loss, updates in reversed(re.findall(r"\| valid \|.*?\| loss ([0-9.]+) \|.*?\| num_updates (\d+)", train_log)):
        return float(loss) if final and updates == final[-1] else None
    return None


def shown(result) -> str:
    """A result's value with the digits fairseq logs it with: accuracy rounded to 0.1, the rest to 0.01."""
    return f"{result['value']:.{1 if result['metric'].startswith('accuracy') else 2}f}"


def results_table(results):
    metric = next((r["metric"] for r in results if "metric" in r), "metric")
    labels = next((r["bins"] for r in results if r.get("bins")), [])
    header = ["arch", "params", "train s", "valid loss", metric] + [f"{label} words" for label, _, _ in labels]
    rows = []
    for result in results:
        if "error" in result:
            error = result["error"].replace("|", "/").replace("\n", " ")  # one table cell
            rows.append([result["arch"], f"failed: {error}"] + [""] * (len(header) - 2))
            continue
        value = shown(result) + (f" ({result['metric']})" if result["metric"] != metric else "")
        cells = [result["arch"], f"{result['params']:,}" if result["params"] else "?", f"{result['train_seconds']:.0f}",
                 f"{result['valid_loss']:.3f}" if result["valid_loss"] is not None else "-", value]
        rows.append(cells + [f"{score:.2f} ({count})" if score is not None else "-"
                             for _, score, count in result.get("bins", [])])
    lines = markdown_table(header, rows)
    if labels:
        lines.append("")
        lines.append("Length bins: BLEU (sentences) by source length in words.")
    return "\n".join(lines) + "\n"


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "error" not in r]
    failed = [r["arch"] for r in results if "error" in r]
    with_bins = [r for r in done if r.get("bins")]
    figure, axes = plt.subplots(1, 2 if with_bins else 1, figsize=(9 if with_bins else 5, 3.2), squeeze=False)
    axis = axes[0][0]
    axis.bar(range(len(done)), [r["value"] for r in done], color="tab:blue")
    axis.set_xticks(range(len(done)))
    axis.set_xticklabels([r["arch"] for r in done], rotation=30, ha="right", fontsize=7)
    axis.set_ylabel(done[0]["metric"] if done else "")
    if failed:  # (they have no bar: say so rather than leave them out without a word)
        axis.set_title(f"failed: {', '.join(failed)}", fontsize=7, color="tab:red")
    for index, result in enumerate(done):
        axis.text(index, result["value"], f"{result['value']:.1f}", ha="center", va="bottom", fontsize=7)
    if with_bins:
        axis = axes[0][1]
        for result in with_bins:
            labels = [label for label, _, _ in result["bins"]]
            axis.plot(labels, [score if score is not None else float("nan") for _, score, _ in result["bins"]],
                      marker="o", lw=1, label=result["arch"])
        axis.set(xlabel="source length (words)", ylabel="BLEU")
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


#: what compare.py writes into --out beside the architectures' folders
OUTPUTS = ("results.md", "results.csv", "compare.png")


def provenance(argv, args) -> dict:
    """What made the results: the commit, the command line, and the options each fairseq-train and
    fairseq-generate got (--preset demo adds its own)."""
    return {"commit": source_commit() or "unknown", "command": shlex.join(["scripts/compare.py", *map(str, argv)]),
            "train_options": shlex.join(map(str, args.train_options)), "generate_args": args.generate_args}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    made = provenance(argv, args)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"error: cannot make --out {args.out}: {error.strerror or error}") from None
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    device = ["--cpu"] if args.device == "cpu" else []
    device += ["--fp16"] if args.fp16 else ["--bf16"] if args.bf16 else []
    for name in OUTPUTS:  # an earlier run's: never read as this run's if this one stops early
        (args.out / name).unlink(missing_ok=True)
    results, interrupted = [], None
    for number, arch in enumerate(args.arch, 1):
        print(f"[{number}/{len(args.arch)}] {arch}: training, logs in {args.out / arch}", flush=True)
        (args.out / arch / "error.log").unlink(missing_ok=True)  # an earlier run's
        try:
            result = train_and_evaluate(args, arch, env, device)
            print(f"[{number}/{len(args.arch)}] {arch}: {result['metric']} = {shown(result)}", flush=True)
        except KeyboardInterrupt:
            interrupted = arch
            break
        except DEMO.CommandFailed as error:
            print(f"[{number}/{len(args.arch)}] {arch}: {error}", flush=True)
            result = {"arch": arch, "error": str(error).split(";")[0]}
        except Exception as error:  # a bug reading one architecture's results: the others still run
            (args.out / arch).mkdir(parents=True, exist_ok=True)
            (args.out / arch / "error.log").write_text(traceback.format_exc())
            print(f"[{number}/{len(args.arch)}] {arch}: {type(error).__name__}: {error} "
                  f"(traceback in {args.out / arch / 'error.log'})", flush=True)
            result = {"arch": arch, "error": f"{type(error).__name__}: {error}"}
        results.append(result)
    if interrupted is not None:
        print(f"\ninterrupted while running {interrupted}", flush=True)
        if not results:
            return 130
    table = (f"Commit {made['commit']}: `{made['command']}`; fairseq-train options `{made['train_options']}`"
             + (f", generate args `{made['generate_args']}`" if made["generate_args"] else "") + "\n\n"
             + results_table(results))
    if interrupted is not None:
        table += f"\nInterrupted while running {interrupted}: it and the architectures after it are not in this table.\n"
    write_output(args.out / "results.md", table)
    rows = io.StringIO(newline="")
    writer = csv.writer(rows)
    writer.writerow(["arch", "params", "train_seconds", "valid_loss", "metric", "value", "bins", *made])
    for r in results:
        writer.writerow([r["arch"], r.get("params"), r.get("train_seconds"), r.get("valid_loss"), r.get("metric"),
                         r.get("value", r.get("error")),
                         ";".join(f"{label}:{score}:{count}" for label, score, count in r.get("bins", [])),
                         *made.values()])
    write_output(args.out / "results.csv", rows.getvalue())
    plot(results, args.out / "compare.png")
    print()
    print(table, end="")
    print(f"\ntable: {args.out / 'results.md'}; plot: {args.out / 'compare.png'}")
    if interrupted is not None:
        return 130
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    sys.exit(main())
