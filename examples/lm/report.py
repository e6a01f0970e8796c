#!/usr/bin/env python
"""Collect evaluate.py --json results of several encodings into table 3 of the LFHC/GCDF paper
(test perplexity on WikiText-103 by evaluation memory length M), the paper's numbers beside ours.

  python examples/lm/report.py WORK_DIR/ppl_*.json --out WORK_DIR/table3.md

Columns are matched by memory M across the files (in increasing M); a file without some M has a
blank (–) there.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from script_helpers import check_output, markdown_table, results_by_name, write_output  # noqa: E402

MISSING = "–"

# Qu et al. 2021, table 3: (M=150, M=640, best ± std over 10 runs)
PAPER = {
    "t5": (25.26, 25.02, "25.02±0.20"),
    "shaw": (25.34, 25.67, "25.34±0.18"),
    "lfhc": (24.26, 23.72, "23.72±0.16"),
    "xl": (24.43, 23.89, "23.89±0.25"),
    "gcdf": (23.87, 23.34, "23.34±0.22"),
}


def load_result(path: Path, fail):
    """{'ppl': {M: value}, 'best': value} of one evaluate.py --json file; fail(message) if it is not one."""
    if not path.is_file():
        fail(f"no file {path}")
    try:
        result = json.loads(path.read_text())
        return {"ppl": {str(m): float(v) for m, v in result["ppl"].items()}, "best": float(result["best"])}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        fail(f"{path} is not an evaluate.py --json result ({type(error).__name__}: {error})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="ppl_ENCODING.json files written by evaluate.py --json")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    check_output(args.out, args.results, p.error)
    rows = results_by_name(args.results, "ppl_", load_result, p.error)
    # every memory of any file, as numbers where they are (so 640 comes after 150), each once
    memories = sorted({m for result in rows.values() for m in result["ppl"]},
                      key=lambda m: (0, int(m), m) if m.isdigit() else (1, 0, m))
    header = (["encoding"] + [f"paper M={m}" for m in ("150", "640")] + ["paper best"]
              + [f"ours M={m}" for m in memories] + ["ours best"])
    table = "\n".join(markdown_table(header, (
        [name, *PAPER.get(name, (MISSING,) * 3)]
        + [f"{result['ppl'][m]:.2f}" if m in result["ppl"] else MISSING for m in memories] + [f"{result['best']:.2f}"]
        for name, result in rows.items())))
    print(table)
    write_output(args.out, table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
