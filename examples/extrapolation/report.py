#!/usr/bin/env python
"""Collect the per-bin BLEU of several encodings (evaluate.py --json files) into one table and a plot
(the FLOATER paper's figure 2).

  python examples/extrapolation/report.py WORK_DIR/bleu_*.json --out WORK_DIR/s2l
writes s2l.md (markdown table: one row per encoding, one column per source-length bin) and s2l.png.
Columns are matched by bin name ([lo,hi)) across the files, ordered by their lower edge; a file
without some bin has a blank (–) there and no point in the plot.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from script_helpers import check_output, markdown_table, results_by_name, write_output  # noqa: E402

MISSING = "–"


def load_result(path: Path, fail):
    """(overall BLEU, {bin name: bin entry}) of one evaluate.py --json file; fail(message) if it is not one."""
    if not path.is_file():
        fail(f"no file {path}")
    try:
        result = json.loads(path.read_text())
        by_bin = {entry["bin"]: {"bleu": float(entry["bleu"]), "sentences": int(entry["sentences"]),
                                 "low": entry.get("low")} for entry in result["bins"]}
        return float(result["bleu"]), by_bin
    except (ValueError, KeyError, TypeError) as error:
        fail(f"{path} is not an evaluate.py --json result ({type(error).__name__}: {error})")


def bin_columns(rows):
    """The bin names of all results, each once, by lower edge (then as first seen)."""
    order = {}
    for _, bins in rows.values():
        for name, entry in bins.items():
            low = entry["low"] if isinstance(entry["low"], (int, float)) else float("inf")
            order.setdefault(name, (low, len(order)))
    return sorted(order, key=order.get)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="bleu_ENCODING.json files")
    p.add_argument("--out", type=Path, required=True, help="output prefix (.md and .png are added)")
    args = p.parse_args(argv)
    # the prefix as given: with_suffix would replace a dotted part (s2l.seed1 -> s2l.md)
    markdown, picture = (check_output(args.out.parent / f"{args.out.name}{suffix}", args.results, p.error)
                         for suffix in (".md", ".png"))
    rows = results_by_name(args.results, "bleu_", load_result, p.error)
    bins = bin_columns(rows)
    table = "\n".join(markdown_table(["encoding", *(f"BLEU {b}" for b in bins), "all"], (
        [name, *(f"{by_bin[b]['bleu']:.2f} (n={by_bin[b]['sentences']})" if b in by_bin else MISSING for b in bins),
         f"{overall:.2f}"] for name, (overall, by_bin) in rows.items())))
    print(table)
    write_output(markdown, table + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (_, by_bin) in rows.items():
        ax.plot(range(len(bins)), [by_bin[b]["bleu"] if b in by_bin else float("nan") for b in bins],
                marker="o", label=name)
    ax.set_xticks(range(len(bins)))
    ax.set_xticklabels(bins)
    ax.set_xlabel("source length")
    ax.set_ylabel("BLEU")
    ax.set_title("Short-to-long extrapolation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(picture, dpi=100)
    print(f"wrote {markdown} and {picture}")


if __name__ == "__main__":
    main()
