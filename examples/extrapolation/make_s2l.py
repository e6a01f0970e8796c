#!/usr/bin/env python
"""Build the FLOATER paper's "short to long" (S2L) split (section 4.3): all training pairs whose
source is shorter than THRESHOLD tokens become the training split, all longer ones the test split.

  python examples/extrapolation/make_s2l.py RAW_DIR OUT_DIR --src en --tgt de [--threshold 80]

RAW_DIR: train.SRC/TGT (and valid.SRC/TGT) as plain text. Lengths are whitespace tokens of the
source line (the paper counts tokens of the tokenised WMT14 En-De corpus; 98.6% of its training
sentences are shorter than 80). Writes OUT_DIR/{train,valid,test}.{SRC,TGT}: train = short training
pairs, valid = short validation pairs, test = long training pairs (plus long validation pairs, plus
every pair of RAW_DIR/test.SRC/TGT if present, e.g. held-out short pairs for an in-length bin).
The two sides of each split must have the same number of lines; OUT_DIR must not be RAW_DIR.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from script_helpers import at_least, check_output, read_parallel, write_output  # noqa: E402

SPLITS = ("train", "valid", "test")


def read(raw, split, src, tgt, fail):
    """The pairs of RAW/SPLIT.{src,tgt}; [] if neither file is there."""
    a, b = raw / f"{split}.{src}", raw / f"{split}.{tgt}"
    if not a.exists() and not b.exists():
        return []
    return read_parallel(a, b, fail)


def write(out, split, pairs, src, tgt):
    write_output(out / f"{split}.{src}", "".join(s + "\n" for s, _ in pairs))
    write_output(out / f"{split}.{tgt}", "".join(t + "\n" for _, t in pairs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--threshold", type=at_least(1), default=80)
    args = p.parse_args(argv)
    if args.src == args.tgt:
        p.error(f"--src and --tgt are both {args.src!r}")
    if not args.raw_dir.is_dir():
        p.error(f"no folder {args.raw_dir}")
    inputs = [args.raw_dir / f"{split}.{lang}" for split in SPLITS for lang in (args.src, args.tgt)]
    outputs = [args.out_dir / path.name for path in inputs]  # the same names, in OUT_DIR
    if args.out_dir.resolve() == args.raw_dir.resolve():
        p.error(f"OUT_DIR {args.out_dir} is RAW_DIR: the split would overwrite its own input")
    for output in outputs:  # e.g. a link to an input; or OUT_DIR a file
        check_output(output, inputs, p.error)
    if not (args.raw_dir / f"train.{args.src}").exists():
        p.error(f"no file {args.raw_dir / f'train.{args.src}'}")
    short = lambda pair: len(pair[0].split()) < args.threshold  # noqa: E731
    train, valid, test = (read(args.raw_dir, split, args.src, args.tgt, p.error) for split in SPLITS)
    splits = {"train": [x for x in train if short(x)], "valid": [x for x in valid if short(x)],
              "test": [x for x in train + valid if not short(x)] + test}
    for name, pairs in splits.items():
        write(args.out_dir, name, pairs, args.src, args.tgt)
    print(" ".join(f"{name}={len(pairs)}" for name, pairs in splits.items()),
          f"(threshold {args.threshold} source tokens)")


if __name__ == "__main__":
    main()
