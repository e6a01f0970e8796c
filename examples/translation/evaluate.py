#!/usr/bin/env python
"""Translate a binarised test split with fairseq-generate and score it with sacrebleu.

  python examples/translation/evaluate.py DATA_BIN CHECKPOINT [--subset test] [--beam 4]
         [--lenpen 0.6] [--bins 80,100,120,140] [--json out.json]

fairseq-generate runs with `--post-process sentencepiece --scoring sacrebleu` (the working path with
sacrebleu 2.x; `fairseq-score --sacrebleu` is broken); hypotheses and references are then taken
from its output (H-/T- lines, detokenised) and scored again with sacrebleu's Python API, overall and,
with --bins, per source-length bin (length = number of whitespace tokens of the detokenised source,
the bins are [b0,b1), [b1,b2), ..., [bn,inf)). Prints `BLEU = x` and one `BLEU[lo,hi) = x (n=...)`
line per bin.
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import sacrebleu

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import (check_checkpoint, check_output, fairseq_command, increasing_counts,  # noqa: E402
                            write_output)

#: --bins B0,B1,...: the lower edges of the source-length bins, checked before fairseq-generate runs
lower_edges = increasing_counts(0, "lengths")


def generate(data_bin, checkpoint, subset, beam, lenpen, batch_size, extra):
    command = [fairseq_command("fairseq-generate"), str(data_bin), "--path", str(checkpoint),
               "--user-dir", str(REPO / "posenc_fairseq"), "--gen-subset", subset,
               "--beam", str(beam), "--lenpen", str(lenpen), "--batch-size", str(batch_size),
               "--post-process", "sentencepiece", "--scoring", "sacrebleu", *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(f"fairseq-generate failed ({done.returncode})")
    return done.stdout, done.stderr


def parse(output):
    """(sources, hypotheses, references) by sentence id from fairseq-generate's S-/H-/T- lines. With
    --nbest N it prints N H- lines per sentence, best first: the first one is scored."""
    src, hyp, ref = {}, {}, {}
    for line in output.split("\n"):  # only fairseq's line ends (a sentence may hold U+2028 and the like)
        match = re.match(r"^([SHT])-(\d+)\t(.*)$", line)
        if match:
            kind, idx, rest = match.group(1), int(match.group(2)), match.group(3)
            if kind == "H":
                rest = rest.split("\t", 1)[1] if "\t" in rest else ""
            {"S": src, "H": hyp, "T": ref}[kind].setdefault(idx, rest)
    ids = sorted(hyp)
    return [src.get(i, "") for i in ids], [hyp[i] for i in ids], [ref.get(i, "") for i in ids]


def bleu(hyps, refs):
    return sacrebleu.corpus_bleu(hyps, [refs]).score if hyps else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_bin")
    p.add_argument("checkpoint")
    p.add_argument("--subset", default="test")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--bins", type=lower_edges, default=[], metavar="B0,B1,...",
                   help="comma-separated lower edges of source-length bins (increasing, >= 0)")
    p.add_argument("--json", type=Path, help="write the scores here")
    p.add_argument("--save-output", type=Path, help="write fairseq-generate's output here")
    args, extra = p.parse_known_args(argv)
    if not Path(args.data_bin).is_dir():
        p.error(f"no folder {args.data_bin}")
    check_checkpoint(args.checkpoint, p.error)
    outputs = [path for path in (args.json, args.save_output) if path is not None]
    for path in outputs:
        check_output(path, [args.data_bin, args.checkpoint], p.error)
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        p.error(f"--json and --save-output are both {args.json}")

    stdout, stderr = generate(args.data_bin, args.checkpoint, args.subset, args.beam, args.lenpen,
                              args.batch_size, extra)
    if args.save_output:
        write_output(args.save_output, stdout)
    srcs, hyps, refs = parse(stdout)
    fairseq_line = next((l for l in (stdout + stderr).splitlines() if "Generate" in l and "BLEU" in l), "")
    if fairseq_line:
        print("fairseq-generate:", fairseq_line.split("|")[-1].strip())
    result = {"checkpoint": str(args.checkpoint), "subset": args.subset, "sentences": len(hyps),
              "bleu": bleu(hyps, refs), "bins": []}
    print(f"BLEU = {result['bleu']:.2f} ({len(hyps)} sentences)")
    if args.bins:
        edges = args.bins
        for lo, hi in zip(edges, edges[1:] + [None]):
            keep = [i for i, s in enumerate(srcs) if len(s.split()) >= lo and (hi is None or len(s.split()) < hi)]
            score = bleu([hyps[i] for i in keep], [refs[i] for i in keep])
            name = f"[{lo},{'inf' if hi is None else hi})"
            result["bins"].append({"bin": name, "low": lo, "high": hi, "sentences": len(keep), "bleu": score})
            print(f"BLEU{name} = {score:.2f} (n={len(keep)})")
    if args.json:
        write_output(args.json, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
