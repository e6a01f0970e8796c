#!/usr/bin/env python
"""Exact accuracy of a classifier checkpoint (sentence_prediction, sentence_ranking) on binarised
subsets: how many examples its criterion scores right, of how many.

  python examples/checkpoint_eval.py DATA_BIN CHECKPOINT [--subsets valid,test] [--batch-size 32]
                                     [--cpu] [--user-dir DIR]

The same pass as fairseq-validate (the checkpoint's task and criterion, fairseq's batches, the
criterion's `ncorrect` and `nsentences` summed over batches), but it prints the counts, where
fairseq-validate logs only the accuracy rounded to 0.1%: one `SUBSET: C of N correct (A%)` line per
subset. An example longer than the model's positions is refused (fairseq-validate's default) unless
it may be skipped (--skip-too-long, then `scored N of M`).

Also imported by the recipes that score checkpoints themselves (glue/evaluate.py, race/evaluate.py).
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import at_least, check_checkpoint, refuse  # noqa: E402


def load_checkpoint(checkpoint, data_bin, cpu, user_dir=None):
    """(model in eval mode, on the GPU unless `cpu`), the checkpoint's cfg, its task reading `data_bin`."""
    from fairseq import checkpoint_utils, utils

    if user_dir is None:
        import posenc_fairseq  # noqa: F401  (its models, and fairseq's checkpoint contents allow-listed)
    else:  # (another copy of posenc_fairseq, say: imported instead of this tree's)
        utils.import_user_module(argparse.Namespace(user_dir=str(user_dir)))
    check_checkpoint(checkpoint, refuse)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                      arg_overrides={"data": str(data_bin)})
    model = models[0].eval()
    if not cpu:
        model.cuda()
    return model, cfg, task


def batches(task, model, subset, batch_size, cpu, skip_too_long=False):
    """(the batches of `subset` in fairseq's order, moved to the GPU unless `cpu`, examples in the
    subset). Examples longer than the task and model allow are refused with a message, or with
    skip_too_long left out of the batches (the caller reports how many it scored)."""
    from fairseq import utils

    try:
        task.load_dataset(subset, combine=False, epoch=1)
    except (FileNotFoundError, KeyError) as error:
        raise SystemExit(f"error: no subset {subset} ({error})") from None
    dataset = task.dataset(subset)
    max_positions = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    _, too_long = dataset.filter_indices_by_size(dataset.ordered_indices(), max_positions)
    if len(too_long) and not skip_too_long:
        raise SystemExit(f"error: {len(too_long)} of {len(dataset)} examples of subset {subset} are longer than the "
                         f"model's max positions ({max_positions}, its --max-positions); --skip-too-long scores "
                         f"the other {len(dataset) - len(too_long)}")
    iterator = task.get_batch_iterator(dataset=dataset, max_sentences=batch_size, max_positions=max_positions,
                                       ignore_invalid_inputs=skip_too_long).next_epoch_itr(shuffle=False)
    samples = (sample if cpu else utils.move_to_cuda(sample) for sample in iterator)
    return samples, len(dataset)


def count_correct(model, cfg, task, subset, batch_size, cpu, skip_too_long=False):
    """(examples right, examples scored, examples in the subset) by the checkpoint's own criterion."""
    criterion = task.build_criterion(cfg.criterion)
    criterion.eval()
    correct = scored = 0
    samples, total = batches(task, model, subset, batch_size, cpu, skip_too_long)
    for sample in samples:
        _, _, logging_output = task.valid_step(sample, model, criterion)
        if "ncorrect" not in logging_output:
            raise SystemExit(f"error: the criterion {type(criterion).__name__} counts no correct examples "
                             f"(a regression target?)")
        correct += int(logging_output["ncorrect"])
        scored += int(logging_output["nsentences"])
    return correct, scored, total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_bin", type=Path)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--subsets", default="valid", help="comma-separated (default: valid)")
    p.add_argument("--batch-size", type=at_least(1), default=32)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--user-dir", type=Path, help="a fairseq --user-dir to import besides posenc_fairseq")
    p.add_argument("--skip-too-long", action="store_true",
                   help="score the examples that fit the model's max positions (default: refuse)")
    args = p.parse_args(argv)
    if not args.data_bin.is_dir():
        p.error(f"no folder {args.data_bin}")
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    model, cfg, task = load_checkpoint(args.checkpoint, args.data_bin, cpu, args.user_dir)
    for subset in args.subsets.split(","):
        correct, scored, total = count_correct(model, cfg, task, subset, args.batch_size, cpu, args.skip_too_long)
        if not scored:
            raise SystemExit(f"error: no examples scored in subset {subset}")
        left_out = f", scored {scored} of {total}" if scored != total else ""
        print(f"{subset}: {correct} of {scored} correct ({100 * correct / scored:.2f}%{left_out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
