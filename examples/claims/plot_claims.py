#!/usr/bin/env python
"""The claims' tables and plots, from the measured results kept in docs/data/ (what docs/claims.md shows).

    python examples/claims/plot_claims.py [--data docs/data] [--out docs/img]

reads process50.jsonl and negation_scope.jsonl (runner.py's results.jsonl lines: one run each,
several files' lines may be concatenated) and short_to_long.json (BLEU per bin and seed), prints
one markdown table per claim with the paper's numbers beside ours, and writes claim_process50.png,
claim_negation_scope.png and claim_short_to_long.png: each run as a dot, the mean as a bar, the
paper's number as a marker. Where process50_sweep.jsonl exists (sweep.py --keep), also the sweep's
table (rates per cell and encoding) and claim_process50_sweep.png.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import negation_scope  # noqa: E402
import process50  # noqa: E402
import sweep  # noqa: E402
from runner import table  # noqa: E402
from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
# (examples/, on the path through runner)
from script_helpers import markdown_table, replaced_whole, write_text_atomic  # noqa: E402


def load_runs(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ordered_entries(runs, order) -> list:
    """Entries in `order` first (those present), then the others in order of appearance."""
    present = list(dict.fromkeys(run["entry"] for run in runs))
    return [entry for entry in order if entry in present] + [entry for entry in present if entry not in order]


def sorted_by_entry(runs, order) -> list:
    entries = ordered_entries(runs, order)
    return sorted(runs, key=lambda run: (entries.index(run["entry"]), run.get("seed", 0)))


def plot_accuracy(runs, order, paper: dict, path: Path, title: str, chance=0.5, ceiling=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = ordered_entries(runs, order)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(entries) + 1.5))
    for row, entry in enumerate(entries):
        scores = [run["test"] for run in runs if run["entry"] == entry and run.get("test") is not None]
        if scores:
            ax.barh(row, statistics.mean(scores), color="#9ecae1")
            ax.plot(scores, [row] * len(scores), "o", color="#08519c", markersize=4)
        if entry in paper:
            ax.plot(paper[entry], row, "kx", markersize=8)
    ax.axvline(chance, color="gray", linestyle=":", linewidth=1)
    if ceiling is not None:
        ax.axvline(ceiling, color="green", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(entries)), entries, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0.4, 1.02)
    ax.set_xlabel("test accuracy (bar: mean; dots: seeds; x: paper" + ("; dashed: Bayes rate)" if ceiling else ")"), fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    with replaced_whole(path) as temporary:  # (a figure stopped midway leaves the earlier one)
        fig.savefig(temporary, dpi=110)
    plt.close(fig)


def plot_short_to_long(data: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins, rows = data["bins"], data["rows"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(9, 4))
    for index, (name, per_bin) in enumerate(rows.items()):
        xs = [position + (index - (len(rows) - 1) / 2) * width for position in range(len(bins))]
        ax.bar(xs, [statistics.mean(seeds) for seeds in per_bin], width, label=name)
        for x, seeds in zip(xs, per_bin):
            ax.plot([x] * len(seeds), seeds, "k.", markersize=3)
    ax.set_xticks(range(len(bins)), bins)
    ax.set_ylabel("BLEU (bar: mean of seeds, dots: seeds)")
    ax.set_xlabel("source length (training: 3-16 words)")
    ax.set_title("Short to long (FLOATER paper, figure 2) at toy scale", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with replaced_whole(path) as temporary:  # (a figure stopped midway leaves the earlier one)
        fig.savefig(temporary, dpi=110)
    plt.close(fig)


def short_to_long_table(data: dict) -> str:
    return "\n".join(markdown_table(["model", *data["bins"]], (
        [f"`{name}`", *(" / ".join(f"{score:.1f}" for score in seeds) + f" [{statistics.mean(seeds):.1f}]"
                        for seeds in per_bin)] for name, per_bin in data["rows"].items()))) + "\n"


def write_tables(doc: Path, tables: dict):
    """Put each table between its markers in `doc` (a new file moved into place: never half-written)."""
    text = doc.read_text()
    for name, body in tables.items():
        pattern = re.compile(rf"(<!-- table:{name}\b[^>]*-->\n).*?(<!-- /table -->)", flags=re.S)
        if not pattern.search(text):
            raise SystemExit(f"{doc}: no <!-- table:{name} --> ... <!-- /table --> markers")
        text = pattern.sub(lambda match: match.group(1) + body + match.group(2), text)
    write_text_atomic(doc, text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=HERE.parents[1] / "docs" / "data")
    parser.add_argument("--out", type=Path, default=HERE.parents[1] / "docs" / "img")
    parser.add_argument("--doc", type=Path, help="also write the tables into this markdown file's markers")
    args = parser.parse_args(argv)
    needed = [args.data / name for name in ("process50.jsonl", "negation_scope.jsonl", "short_to_long.json")]
    missing = [str(path) for path in needed if not path.is_file()]
    if missing:  # (before any figure is drawn: never half the set)
        parser.error(f"no {', '.join(missing)}: --data holds runner.py's results.jsonl of process50.py and "
                     "negation_scope.py under those names, and short_to_long.py's results")
    args.out.mkdir(parents=True, exist_ok=True)

    runs = load_runs(args.data / "process50.jsonl")
    order = ["roberta_nope", "roberta_t5_nob", "roberta_t5", "roberta_at5_nob", "roberta_at5"]
    runs = sorted_by_entry(runs, order)
    tables = {"process50": table(runs, "Process-50 (AT5 paper, table 1); paper: its accuracy",
                                 {a: f"{v:.3f}" for a, v in process50.PAPER.items()})}
    plot_accuracy(runs, order, process50.PAPER, args.out / "claim_process50.png",
                  "Process-50 (AT5 paper, table 1)", ceiling=process50.bayes_accuracy())

    runs = load_runs(args.data / "negation_scope.jsonl")
    order = negation_scope.ENTRIES
    runs = sorted_by_entry(runs, order)
    tables["negation_scope"] = table(runs, "Negation scope (LFHC/GCDF paper's ordering); paper: its SST-2 accuracy (%)",
                                     negation_scope.PAPER, reach=negation_scope.REACH)
    # the paper's SST-2 accuracies (%) as fractions, on the same axis
    paper = {entry: float(value) / 100 for entry, value in negation_scope.PAPER.items()}
    plot_accuracy(runs, order, paper, args.out / "claim_negation_scope.png",
                  "Negation scope (x: the paper's SST-2 accuracy, another task)", ceiling=1.0)

    kept = args.data / "process50_sweep.jsonl"  # sweep.py --keep: every finished run of the robustness sweep
    if kept.exists():
        runs = list(sweep.recorded(kept, failed=True).values())  # one record per run, as sweep.py counts them
        setups = sorted({(run["device"], run["epochs"], tuple(run["sizes"])) for run in runs})
        if len(setups) > 1:  # rates over runs of other budgets or devices would mix
            raise SystemExit(f"{kept}: runs of {len(setups)} set-ups (device, epochs, sizes): {setups}; "
                             f"keep one set-up per file")
        present = list(dict.fromkeys(run["arch"] for run in runs))  # the default four first, then the variants
        encodings = [arch for arch in sweep.ENCODINGS if arch in present] + [a for a in present if a not in sweep.ENCODINGS]
        tables["process50_sweep"] = sweep.markdown(runs, encodings)
        with replaced_whole(args.out / "claim_process50_sweep.png") as temporary:
            sweep.plot(runs, encodings, temporary)

    data = json.loads((args.data / "short_to_long.json").read_text())
    tables["short_to_long"] = "BLEU per source-length bin, seeds 1 / 2 / 3 [mean]\n\n" + short_to_long_table(data)
    plot_short_to_long(data, args.out / "claim_short_to_long.png")
    print("\n".join(tables.values()))
    if args.doc:
        write_tables(args.doc, tables)
    return 0


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    sys.exit(main())
