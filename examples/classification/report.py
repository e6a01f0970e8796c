#!/usr/bin/env python
"""Collect evaluate.py --json results (WORK_DIR/<encoding>/<TASK>.json) into table 1 of the LFHC/GCDF
paper, the paper's mean±std over 10 runs beside ours.

  python examples/classification/report.py WORK_DIR --out WORK_DIR/table1.md
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from script_helpers import check_output, markdown_table, write_output  # noqa: E402

TASKS = ["IMDB", "SST-2", "SNLI", "QNLI", "QQP", "MNLI"]
# Qu et al. 2021, table 1 (acc; QQP avg(acc/f1); MNLI avg(m/mm))
PAPER = {
    "t5": ["88.37±0.08", "82.91±0.32", "86.09±0.16", "80.09±0.53", "72.28±0.51", "73.54±0.14"],
    "shaw": ["88.39±0.08", "83.03±0.24", "86.13±0.11", "80.07±0.64", "71.68±0.52", "73.79±0.19"],
    "lfhc": ["88.78±0.06", "83.26±0.29", "86.48±0.14", "80.62±0.39", "72.00±0.43", "74.18±0.18"],
    "xl": ["88.45±0.09", "84.25±0.35", "86.27±0.15", "80.16±0.45", "71.13±0.48", "75.24±0.21"],
    "gcdf": ["88.98±0.04", "84.63±0.22", "86.52±0.08", "81.04±0.36", "71.64±0.46", "75.83±0.18"],
}


def read_result(path: Path, fail):
    """(the value to two decimals, its metric, whether it is the table's) of one evaluate.py --json file
    (evaluate.py says where it scored another metric or subset); fail(message) if it is not one."""
    try:
        result = json.loads(path.read_text())
        return f"{float(result['value']):.2f}", result.get("metric"), bool(result.get("as_in_table", True))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        fail(f"{path} is not a result of evaluate.py --json ({type(error).__name__}: {error})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work_dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--encodings", nargs="+", metavar="NAME",
                   help="the encodings (WORK_DIR/<encoding>) of this table; default: every folder with a result")
    args = p.parse_args(argv)
    if not args.work_dir.is_dir():
        p.error(f"no folder {args.work_dir}")
    files = [path for path in sorted(args.work_dir.glob("*/*.json"))
             if path.stem in TASKS and (args.encodings is None or path.parent.name in args.encodings)]
    check_output(args.out, files, p.error)
    missing = sorted(set(args.encodings or ()) - {path.parent.name for path in files})
    if missing:
        p.error(f"no results of {', '.join(missing)} in {args.work_dir} (<encoding>/<TASK>.json)")
    if not files:
        p.error(f"no results in {args.work_dir} (<encoding>/<TASK>.json, TASK one of {' '.join(TASKS)})")
    results = {}
    for path in files:
        value, metric, as_in_table = read_result(path, p.error)
        results.setdefault(path.parent.name, {})[path.stem] = value if as_in_table else f"{value} ({metric})"
    tasks = [t for t in TASKS if any(t in r for r in results.values())]
    header = ["encoding"] + [column for t in tasks for column in (f"{t} paper", f"{t} ours")]
    order = list(PAPER) + sorted(set(results) - set(PAPER))  # the paper's row order, then the others
    rows = []
    for encoding, row in sorted(results.items(), key=lambda item: order.index(item[0])):
        paper = dict(zip(TASKS, PAPER.get(encoding, ["–"] * len(TASKS))))
        rows.append([encoding] + [cell for t in tasks for cell in (paper[t], row.get(t, "–"))])
    table = "\n".join(markdown_table(header, rows))
    print(table)
    write_output(args.out, table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
