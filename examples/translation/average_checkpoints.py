#!/usr/bin/env python
"""Average the parameters of the last N checkpoints (the FLOATER paper's appendix B.2, step 6).

fairseq's own scripts/average_checkpoints.py is not part of the pip package; this does the same job
with the same interface subset:
  python examples/translation/average_checkpoints.py --inputs SAVE_DIR --num-epoch-checkpoints 5 --output avg.pt
  python examples/translation/average_checkpoints.py --inputs SAVE_DIR --num-update-checkpoints 5 --output avg.pt
  python examples/translation/average_checkpoints.py --inputs a.pt b.pt c.pt --output avg.pt
Checkpoints are read with fairseq's checkpoint_utils (after importing posenc_fairseq, so that they
load under torch >= 2.6). The newest checkpoint is the last one: the highest epoch / update number
with --num-*-checkpoints, the last one given otherwise. Floating-point entries of the model are
averaged (in float64) and saved as float32, whatever their dtype (float16 too, as fairseq's script
does); integer entries (e.g. counters) and everything outside the model are taken from the newest.
All checkpoints must hold the same model entries with the same shapes, and have been trained with the
same encoding options (their `trained_with` entries, posenc_fairseq/encodings/trained_with.py, equal
where present: checkpoints saved before the package wrote them have none).
"""
import argparse
import collections
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import posenc_fairseq  # noqa: E402,F401  (allow-lists fairseq's checkpoint contents)
from fairseq import checkpoint_utils  # noqa: E402
from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from posenc_fairseq.encodings import trained_with  # noqa: E402
from script_helpers import at_least, check_checkpoint, check_output, replaced_whole  # noqa: E402


def last_checkpoints(directory, n, by_update):
    """The paths of the n newest checkpoints in `directory`, oldest first."""
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt$" if by_update else r"checkpoint(\d+)\.pt$")
    found = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    if len(found) < n:
        raise SystemExit(f"error: found {len(found)} checkpoints in {directory}, need {n}")
    return [path for _, path in sorted(found)[-n:]]


def is_trained_with(key):
    """Whether `key` is an encoding's entry of what its weights were trained with (not averaged)."""
    return key.rsplit(".", 1)[-1] == trained_with.KEY


def entries(model):
    """{name: (shape, dtype)} of a model state: what must agree between the checkpoints averaged (the
    trained_with entries aside: checkpoints saved before the package wrote them lack them)."""
    return {key: (tuple(value.shape), value.dtype) for key, value in model.items() if not is_trained_with(key)}


def check_same_entries(first_path, first, path, other):
    """SystemExit naming the first entry that one model lacks or holds with another shape or kind
    (`first`, `other`: entries())."""
    missing = sorted(set(first) ^ set(other))
    if missing:
        key = missing[0]
        raise SystemExit(f"error: model entry {key} is in {first_path if key in first else path} "
                         f"but not in {path if key in first else first_path}")
    for key, (shape, dtype) in other.items():
        first_shape, first_dtype = first[key]
        if shape != first_shape:
            raise SystemExit(f"error: model entry {key} has shape {first_shape} in {first_path} but {shape} in {path}")
        if dtype.is_floating_point != first_dtype.is_floating_point:
            raise SystemExit(f"error: model entry {key} is {first_dtype} in {first_path} but {dtype} in {path}")


def average(paths):
    """The state of the newest (last) checkpoint with its floating-point model entries averaged over
    all of `paths`."""
    summed, first, state = collections.OrderedDict(), None, None
    holder = {}  # the checkpoint each trained_with entry was read from
    for path in paths:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        model = state["model"]
        if first is None:
            first = (path, entries(model))
        else:  # models that differ in their entries cannot be averaged entry by entry
            check_same_entries(*first, path, entries(model))
        for key, value in model.items():
            if is_trained_with(key):  # what the weights were trained with: not averaged
                if key in summed and not torch.equal(summed[key], value):
                    raise SystemExit(f"error: model entry {key} differs between {holder[key]} and {path}: their "
                                     "encodings were built differently (another encoding or other options), and "
                                     "their average is no model")
                summed[key], holder[key] = value, path
            elif value.is_floating_point():
                summed[key] = value.double() + summed[key] if key in summed else value.double()
            else:
                summed[key] = value  # the newest one's, once the loop ends
    averaged = collections.OrderedDict()
    for key, value in summed.items():
        averaged[key] = (value / len(paths)).float() if value.is_floating_point() and not is_trained_with(key) \
            else value
    state["model"] = averaged
    return state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", nargs="+", required=True)
    p.add_argument("--output", required=True)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=at_least(1))
    group.add_argument("--num-update-checkpoints", type=at_least(1))
    args = p.parse_args(argv)
    count = args.num_epoch_checkpoints if args.num_epoch_checkpoints is not None else args.num_update_checkpoints
    if count is not None:
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            p.error("with --num-*-checkpoints give one folder as --inputs")
        paths = last_checkpoints(args.inputs[0], count, by_update=args.num_update_checkpoints is not None)
    else:
        paths = args.inputs
    for path in paths:
        check_checkpoint(path, p.error)
    check_output(args.output, paths, p.error)
    state = average(paths)
    replacing = os.path.isfile(args.output)  # (not an input: check_output refused those)
    try:  # saved beside the output first: the output is its old self or the whole average, never half written
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with replaced_whole(args.output) as temporary:
            torch.save(state, temporary)
    except OSError as error:
        raise SystemExit(f"error: cannot write {args.output}: {error.strerror or error}") from None
    if replacing:  # replaced as by fairseq's own script, but said: the earlier file is gone
        print(f"replaced the earlier {args.output}")
    print(f"averaged {len(paths)} checkpoints: {', '.join(os.path.basename(p) for p in paths)} -> {args.output}")


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    main()
