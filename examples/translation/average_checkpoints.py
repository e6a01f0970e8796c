#!/usr/bin/env python
"""Average the parameters of the last N checkpoints (the FLOATER paper's appendix B.2, step 6).

fairseq's own scripts/average_checkpoints.py is not part of the pip package; this does the same job
with the same interface subset:
  python examples/translation/average_checkpoints.py --inputs SAVE_DIR --num-epoch-checkpoints 5 --output avg.pt
  python examples/translation/average_checkpoints.py --inputs SAVE_DIR --num-update-checkpoints 5 --output avg.pt
  python examples/translation/average_checkpoints.py --inputs a.pt b.pt c.pt --output avg.pt
Checkpoints are read with fairseq's checkpoint_utils (after importing posenc_fairseq, so that they
load under torch >= 2.6); everything except the model weights is taken from the newest one.
"""
import argparse
import collections
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import posenc_fairseq  # noqa: E402,F401  (allow-lists fairseq's checkpoint contents)
from fairseq import checkpoint_utils  # noqa: E402


def last_checkpoints(directory, n, by_update):
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    if len(found) < n:
        raise SystemExit(f"found {len(found)} checkpoints in {directory}, need {n}")
    return [path for _, path in sorted(found)[-n:]]


def average(paths):
    summed, state = collections.OrderedDict(), None
    for path in paths:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        for key, value in state["model"].items():
            value = value.double() if value.is_floating_point() else value
            if key not in summed:
                summed[key] = value.clone()
            elif value.is_floating_point():
                summed[key] += value
    model = collections.OrderedDict()
    for key, value in summed.items():
        model[key] = (value / len(paths)).float() if value.is_floating_point() else value
    state["model"] = model
    return state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", nargs="+", required=True)
    p.add_argument("--output", required=True)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int)
    group.add_argument("--num-update-checkpoints", type=int)
    args = p.parse_args(argv)
    if args.num_epoch_checkpoints or args.num_update_checkpoints:
        if len(args.inputs) != 1:
            raise SystemExit("with --num-*-checkpoints give one directory as --inputs")
        paths = last_checkpoints(args.inputs[0], args.num_epoch_checkpoints or args.num_update_checkpoints,
                                 by_update=bool(args.num_update_checkpoints))
    else:
        paths = args.inputs
    state = average(paths)
    torch.save(state, args.output)
    print(f"averaged {len(paths)} checkpoints: {', '.join(os.path.basename(p) for p in paths)} -> {args.output}")


if __name__ == "__main__":
    main()
