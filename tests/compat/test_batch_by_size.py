"""fairseq-fixed drops a last batch whose size is not a multiple of --required-batch-size-multiple;
the plugin keeps it, for every model (posenc_fairseq/compat/batch_by_size.py)."""
import logging
import re

import numpy as np
import pytest

import posenc_fairseq  # noqa: F401  (applies the fix)
from fairseq.data import data_utils
from posenc_fairseq.compat.batch_by_size import SWITCH, drops_last_batch, keeping_last_batch
from util import QUICK_TRAIN, TINY_TRANSFORMER, USER_DIR, run


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


def test_switched_off_it_gives_fairseq_fixeds_batches_and_refuses_unknown_values(monkeypatch):
    indices = np.arange(100, dtype=np.int64)
    stock = data_utils.batch_by_size.__wrapped__(indices, num_tokens_fn=lambda i: 10, max_sentences=64,
                                                 required_batch_size_multiple=8)
    monkeypatch.setenv(SWITCH, "off")
    batches = data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, max_sentences=64,
                                       required_batch_size_multiple=8)
    assert [batch.tolist() for batch in batches] == [batch.tolist() for batch in stock]
    monkeypatch.setenv(SWITCH, "no")
    with pytest.raises(ValueError, match="POSENC_KEEP_LAST_BATCH='no': expected one of on, off"):
        data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, max_sentences=64)


def test_the_first_batch_kept_is_logged_once(caplog):
    batch_by_size = keeping_last_batch(data_utils.batch_by_size.__wrapped__)
    with caplog.at_level(logging.INFO, logger="posenc_fairseq.compat.batch_by_size"):
        batch_by_size(np.arange(64, dtype=np.int64), num_tokens_fn=lambda i: 1, max_sentences=8,
                      required_batch_size_multiple=8)  # nothing dropped
        assert not caplog.records
        for _ in range(2):
            batch_by_size(np.arange(100, dtype=np.int64), num_tokens_fn=lambda i: 1, max_sentences=64,
                          required_batch_size_multiple=8)
    assert [record.getMessage()[:39] for record in caplog.records] == [
        "kept a last batch of 4 sentence(s) that"]


def test_stock_training_sees_every_sentence_unless_switched_off(translation_data, tmp_path):
    """Training batches change for stock architectures too: a stock `transformer` under --user-dir
    trains on all 30 sentences of an epoch (one batch more than without the plugin) and says so in
    its log; with POSENC_KEEP_LAST_BATCH=off it repeats the run without --user-dir exactly."""
    def train(*options, env=None):
        out = run(["fairseq-train", translation_data, "--task", "translation", "--arch", "transformer",
                   *TINY_TRANSFORMER, *QUICK_TRAIN, "--train-subset", "valid", "--max-sentences", "8",
                   "--max-epoch", "1", "--disable-validation", "--no-save", "--save-dir", tmp_path, *options], env=env)
        steps = re.findall(r"train_inner \| epoch 001: .*? (loss=[^,]+), .*?(bsz=[^,]+), (num_updates=[^,]+), "
                           r"lr=[^,]+, (gnorm=[^,]+)", out)
        return steps, "kept a last batch of 6 sentence(s)" in out

    stock, stock_logged = train()
    kept, kept_logged = train("--user-dir", USER_DIR)
    switched_off, switched_off_logged = train("--user-dir", USER_DIR, env={SWITCH: "off"})
    assert len(stock) == 3 and len(kept) == 4
    assert switched_off == stock
    assert kept_logged and not stock_logged and not switched_off_logged
