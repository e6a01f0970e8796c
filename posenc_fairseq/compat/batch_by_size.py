"""Keep the last batch that fairseq-fixed 0.12.3.1's `batch_by_size` silently drops.

`fairseq.data.data_utils.batch_by_size` ends with
    if bsz_mult > 1 and len(b[-1]) % bsz_mult != 0: b = b[:-1]
although its own docstring allows a batch "less than N or a multiple of N". So with `--batch-size N`
(and the default `--required-batch-size-multiple 8`) fairseq-generate, validation and every
evaluation skip up to 7 sentences with no warning: BLEU or loss on a subset. fairseq orders a data
set by length before batching, so the sentences lost are the longest ones.

Fixed for every model, stock ones included, not only for this plugin's:
- batching is the task's, done without the model (`FairseqTask.get_batch_iterator` is given none);
- the stock architectures this plugin is compared against (`transformer`, `roberta_base`,
  `transformer_lm`, run with the same `--user-dir`) must be scored on the same sentences as its
  encodings: a fix for our models only would score the two on different test sets;
- training keeps the batch too, so each epoch sees every sentence (stock fairseq-fixed never trains
  on the dropped tail). A stock architecture trained with the plugin's --user-dir therefore takes
  one more, smaller, batch per epoch than without it. The first batch kept is logged, and
  POSENC_KEEP_LAST_BATCH=off gives fairseq-fixed's batches, to repeat a stock run exactly.
fairseq calls `data_utils.batch_by_size` through the module, and imports the --user-dir before it
builds any iterator, so replacing it there restores the full data set everywhere.
"""
import functools
import logging

import numpy as np

from ..switches import choice

logger = logging.getLogger(__name__)

#: the environment variable that turns the fix off ("off": fairseq-fixed's batches), read at each call
SWITCH = "POSENC_KEEP_LAST_BATCH"
MODES = ("on", "off")


def keeping() -> bool:
    """POSENC_KEEP_LAST_BATCH now ("on" where unset); an unknown value is refused."""
    return choice(SWITCH, MODES, "on") == "on"


def drops_last_batch(batch_by_size) -> bool:
    """Whether `batch_by_size` loses the sentence left over after one batch of 8 (multiple 8)."""
    batches = batch_by_size(np.arange(9, dtype=np.int64), num_tokens_fn=lambda index: 1, max_sentences=8,
                            required_batch_size_multiple=8)
    return sum(len(batch) for batch in batches) < 9


def keeping_last_batch(batch_by_size):
    """`batch_by_size` with the sentences it dropped added back as one last batch (unless
    POSENC_KEEP_LAST_BATCH=off); the first time it adds one, it says so in the log."""
    logged = []

    @functools.wraps(batch_by_size)
    def batch_by_size_keeping_last_batch(indices, *args, **kwargs):
        batches = batch_by_size(indices, *args, **kwargs)
        if kwargs.get("fixed_shapes") is not None:  # that path drops nothing, and reorders `indices`
            return batches
        if not keeping():
            return batches
        covered = sum(len(batch) for batch in batches)
        if covered < len(indices):  # batches are consecutive slices of `indices`: the tail was dropped
            batches = list(batches) + [np.asarray(indices[covered:], dtype=np.int64)]
            if not logged:
                logged.append(True)
                logger.info(f"kept a last batch of {len(indices) - covered} sentence(s) that fairseq-fixed's "
                            f"batch_by_size drops, for every model, stock ones included ({SWITCH}=off: "
                            f"fairseq-fixed's batches; posenc_fairseq/compat/batch_by_size.py)")
        return batches

    return batch_by_size_keeping_last_batch


def apply():
    import fairseq
    from fairseq.data import data_utils

    if not drops_last_batch(data_utils.batch_by_size):
        return None
    data_utils.batch_by_size = keeping_last_batch(data_utils.batch_by_size)
    return (f"fairseq {fairseq.__version__}'s batch_by_size drops a last batch whose size is not a multiple of "
            f"--required-batch-size-multiple (generate and validation skip the longest sentences); kept, for every model")
