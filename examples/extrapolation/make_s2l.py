#!/usr/bin/env python
"""Build the FLOATER paper's "short to long" (S2L) split (section 4.3): all training pairs whose
source is shorter than THRESHOLD tokens become the training split, all longer ones the test split.

  python examples/extrapolation/make_s2l.py RAW_DIR OUT_DIR --src en --tgt de [--threshold 80]

RAW_DIR: train.SRC/TGT (and valid.SRC/TGT) as plain text. Lengths are whitespace tokens of the
source line (the paper counts tokens of the tokenised WMT14 En-De corpus; 98.6% of its training
sentences are shorter than 80). Writes OUT_DIR/{train,valid,test}.{SRC,TGT}: train = short training
pairs, valid = short validation pairs, test = long training pairs (plus long validation pairs, plus
every pair of RAW_DIR/test.SRC/TGT if present, e.g. held-out short pairs for an in-length bin).
"""
import argparse
from pathlib import Path


def read(raw, split, src, tgt):
    a, b = raw / f"{split}.{src}", raw / f"{split}.{tgt}"
    if not a.exists():
        return []
    return list(zip(a.read_text(encoding="utf-8").splitlines(), b.read_text(encoding="utf-8").splitlines()))


def write(out, split, pairs, src, tgt):
    (out / f"{split}.{src}").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (out / f"{split}.{tgt}").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--threshold", type=int, default=80)
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    short = lambda pair: len(pair[0].split()) < args.threshold  # noqa: E731
    train, valid = read(args.raw_dir, "train", args.src, args.tgt), read(args.raw_dir, "valid", args.src, args.tgt)
    splits = {"train": [x for x in train if short(x)], "valid": [x for x in valid if short(x)],
              "test": [x for x in train + valid if not short(x)] + read(args.raw_dir, "test", args.src, args.tgt)}
    for name, pairs in splits.items():
        write(args.out_dir, name, pairs, args.src, args.tgt)
    print(" ".join(f"{name}={len(pairs)}" for name, pairs in splits.items()),
          f"(threshold {args.threshold} source tokens)")


if __name__ == "__main__":
    main()
