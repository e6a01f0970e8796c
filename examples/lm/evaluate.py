#!/usr/bin/env python
"""Test perplexity of a language model with fairseq-eval-lm at each evaluation memory length M of the
LFHC/GCDF paper's table 3 (M = 150 and 640), and the best of them.

  python examples/lm/evaluate.py DATA_BIN CHECKPOINT [--memory 150 640] [--block 150] [--subset test]
                                 [--batch-size 8] [--cpu] [--json out.json] [-- extra fairseq-eval-lm options]

Transformer-XL (and the paper) evaluate with a memory of M cached hidden states per layer. A
fairseq language model has no such cache; its counterpart is `fairseq-eval-lm --context-window M`:
the text is scored in blocks of --block tokens, each fed together with the M tokens before it, so
every scored token sees at least M earlier tokens (each window starts at position 0 for the model;
relative encodings see the true distances inside it). Prints `ppl M=<M> = <value>` per M and
`ppl best = <value>`.
"""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import at_least, check_checkpoint, check_output, fairseq_command, write_output  # noqa: E402


def eval_lm(data_bin, checkpoint, memory, block, subset, batch_size, cpu, extra):
    command = [os.environ.get("FAIRSEQ_EVAL_LM", fairseq_command("fairseq-eval-lm")), str(data_bin), "--path", str(checkpoint),
               "--user-dir", str(REPO / "posenc_fairseq"), "--gen-subset", subset,
               "--sample-break-mode", "none", "--tokens-per-sample", str(memory + block),
               "--context-window", str(memory), "--batch-size", str(batch_size), "--num-workers", "0", *extra]
    if cpu:
        command.append("--cpu")
    print("+", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(f"fairseq-eval-lm failed ({done.returncode})")
    match = re.findall(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.eE+]+|inf)", done.stdout + done.stderr)
    if not match:
        raise SystemExit("no perplexity in fairseq-eval-lm's output:\n" + (done.stdout + done.stderr)[-3000:])
    return float(match[-1][1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_bin")
    p.add_argument("checkpoint")
    p.add_argument("--memory", type=at_least(0), nargs="+", default=[150, 640], help="context windows M (table 3)")
    p.add_argument("--block", type=at_least(1), default=150, help="tokens scored per window (XL's segment length)")
    p.add_argument("--subset", default="test")
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", type=Path, help="write {'ppl': {M: value}, 'best': value} here")
    args, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    if not Path(args.data_bin).is_dir():
        p.error(f"no folder {args.data_bin}")
    check_checkpoint(args.checkpoint, p.error)
    if args.json:
        check_output(args.json, [args.data_bin, args.checkpoint], p.error)
    results = {}
    for memory in args.memory:
        results[memory] = eval_lm(args.data_bin, args.checkpoint, memory, args.block, args.subset,
                                  args.batch_size, args.cpu, extra)
        print(f"ppl M={memory} = {results[memory]:.2f}", flush=True)
    best = min(results.values())
    print(f"ppl best = {best:.2f}")
    if args.json:
        write_output(args.json, json.dumps({"ppl": {str(m): v for m, v in results.items()}, "best": best,
                                            "block": args.block, "subset": args.subset}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
