"""fairseq-fixed drops a last batch whose size is not a multiple of --required-batch-size-multiple;
the plugin keeps it, for every model (posenc_fairseq/compat/batch_by_size.py)."""
import numpy as np

import posenc_fairseq  # noqa: F401  (applies the fix)
from fairseq.data import data_utils
from posenc_fairseq.compat.batch_by_size import drops_last_batch
from util import USER_DIR, run


def test_every_index_is_batched_exactly_once():
    indices = np.arange(100, dtype=np.int64)
    for max_sentences in (1, 8, 64):
        batches = data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, max_sentences=max_sentences,
                                           required_batch_size_multiple=8)
        assert sorted(np.concatenate(batches).tolist()) == list(range(100))


def test_the_stock_function_would_have_dropped_them():
    stock = data_utils.batch_by_size.__wrapped__
    batches = stock(np.arange(100, dtype=np.int64), num_tokens_fn=lambda i: 10, max_sentences=64,
                    required_batch_size_multiple=8)
    assert sum(len(b) for b in batches) == 96
    assert drops_last_batch(stock) and not drops_last_batch(data_utils.batch_by_size)


def test_a_stock_architecture_translates_every_sentence(translation_data, tiny_checkpoint):
    """The decision to fix batching for every model: fairseq's own `transformer`, run with the
    plugin as a baseline, is scored on the same 20 test sentences as the plugin's encodings
    (tests/test_cli.py), not on the 16 of two full batches of 8."""
    out = run(["fairseq-generate", translation_data, "--user-dir", USER_DIR, "--path", tiny_checkpoint("transformer"),
               "--beam", "1", "--cpu", "--max-sentences", "8"])
    assert "Translated 20 sentences" in out
