"""fairseq-fixed drops a last batch whose size is not a multiple of --required-batch-size-multiple;
the plugin keeps it."""
import numpy as np

import posenc_fairseq  # noqa: F401  (installs the fix)
from fairseq.data import data_utils


def test_every_index_is_batched_exactly_once():
    indices = np.arange(100, dtype=np.int64)
    for max_sentences in (1, 8, 64):
        batches = data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, max_sentences=max_sentences,
                                           required_batch_size_multiple=8)
        assert sorted(np.concatenate(batches).tolist()) == list(range(100))


def test_the_stock_function_would_have_dropped_them():
    from posenc_fairseq.batching_fix import _original

    batches = _original(np.arange(100, dtype=np.int64), num_tokens_fn=lambda i: 10, max_sentences=64,
                        required_batch_size_multiple=8)
    assert sum(len(b) for b in batches) == 96
