"""scripts/fairseq_data_utils_fast.py (the pure-Python batch_by_size a GPU machine without fairseq's
compiled extensions trains with) makes the same batches as fairseq's Cython version."""
import numpy as np
from fairseq.data import data_utils_fast as compiled

from util import REPO, load_script


def test_same_batches_as_fairseqs_compiled_batch_by_size():
    port = load_script(REPO / "scripts" / "fairseq_data_utils_fast.py")
    rng = np.random.default_rng(0)
    for _ in range(500):
        count = int(rng.integers(0, 150))
        indices = rng.permutation(count).astype(np.int64)
        max_tokens = int(rng.choice([0, -1, 64, 128, 500]))
        sizes = rng.integers(1, 60, count).astype(np.int64)
        if max_tokens > 0:
            sizes = np.minimum(sizes, max_tokens)
        max_sentences, multiple = int(rng.choice([0, -1, 1, 8, 32])), int(rng.choice([1, 8]))
        expected = compiled.batch_by_size_vec(indices, sizes, max_tokens, max_sentences, multiple)
        got = port.batch_by_size_vec(indices, sizes, max_tokens, max_sentences, multiple)
        assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
        by_function = port.batch_by_size_fn(indices, lambda index: sizes[list(indices).index(index)], max_tokens,
                                            max_sentences, multiple)
        assert all(np.array_equal(a, b) for a, b in zip(by_function, expected))
