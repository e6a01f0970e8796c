#!/usr/bin/env python
"""Collect evaluate.py --json results of several encodings into table 3 of the LFHC/GCDF paper
(test perplexity on WikiText-103 by evaluation memory length M), the paper's numbers beside ours.

  python examples/lm/report.py WORK_DIR/ppl_*.json --out WORK_DIR/table3.md
"""
import argparse
import json
from pathlib import Path

# Qu et al. 2021, table 3: (M=150, M=640, best ± std over 10 runs)
PAPER = {
    "t5": (25.26, 25.02, "25.02±0.20"),
    "shaw": (25.34, 25.67, "25.34±0.18"),
    "lfhc": (24.26, 23.72, "23.72±0.16"),
    "xl": (24.43, 23.89, "23.89±0.25"),
    "gcdf": (23.87, 23.34, "23.34±0.22"),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="ppl_ENCODING.json files written by evaluate.py --json")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows = {}
    for path in args.results:
        name = path.stem[len("ppl_"):] if path.stem.startswith("ppl_") else path.stem
        rows[name] = json.loads(path.read_text())
    memories = list(next(iter(rows.values()))["ppl"])
    header = (["encoding"] + [f"paper M={m}" for m in ("150", "640")] + ["paper best"]
              + [f"ours M={m}" for m in memories] + ["ours best"])
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, result in rows.items():
        paper = PAPER.get(name, ("–", "–", "–"))
        cells = [name, *map(str, paper)] + [f"{result['ppl'][m]:.2f}" for m in memories] + [f"{result['best']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
