#!/usr/bin/env python
"""Collect the per-bin BLEU of several encodings (evaluate.py --json files) into one table and a plot
(the FLOATER paper's figure 2).

  python examples/extrapolation/report.py WORK_DIR/bleu_*.json --out WORK_DIR/s2l
writes s2l.md (markdown table: one row per encoding, one column per source-length bin) and s2l.png.
"""
import argparse
import json
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="bleu_ENCODING.json files")
    p.add_argument("--out", type=Path, required=True, help="output prefix (.md and .png are added)")
    args = p.parse_args(argv)
    rows = {}
    for path in args.results:
        name = path.stem[len("bleu_"):] if path.stem.startswith("bleu_") else path.stem
        rows[name] = json.loads(path.read_text())
    bins = [b["bin"] for b in next(iter(rows.values()))["bins"]]
    lines = ["| encoding | " + " | ".join(f"BLEU {b}" for b in bins) + " | all |",
             "|---" * (len(bins) + 2) + "|"]
    for name, result in rows.items():
        cells = [f"{b['bleu']:.2f} (n={b['sentences']})" for b in result["bins"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {result['bleu']:.2f} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, result in rows.items():
        ax.plot(range(len(bins)), [b["bleu"] for b in result["bins"]], marker="o", label=name)
    ax.set_xticks(range(len(bins)))
    ax.set_xticklabels(bins)
    ax.set_xlabel("source length")
    ax.set_ylabel("BLEU")
    ax.set_title("Short-to-long extrapolation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
