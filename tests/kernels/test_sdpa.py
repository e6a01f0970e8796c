"""kernels/sdpa.py: the float mask handed to CUDA's fused kernels is aligned (its start and strides),
equal to the terms it came from, and carries their gradient. Checked on CPU tensors: the layout rule
is the same on every device, only `attend` applies it (on CUDA)."""
import torch

from posenc_fairseq.encodings.positions import relative_shift
from posenc_fairseq.kernels.sdpa import MASK_ALIGNMENT_BYTES, aligned_mask


def is_aligned(tensor):
    elements = MASK_ALIGNMENT_BYTES // tensor.element_size()
    return (tensor.stride(-1) == 1 and tensor.storage_offset() % elements == 0
            and all(stride % elements == 0 for size, stride in zip(tensor.shape[:-1], tensor.stride()[:-1]) if size > 1))


def diagonal_view(queries, keys, dtype):
    """LFHC's key term as its no-grad SDPA call got it: relative_shift's view of per-distance scores
    (row stride N - 1, start Tq - 1), which CUDA's memory-efficient kernel read out of alignment."""
    per_distance = torch.randn(2, 3, queries, queries + keys - 1, dtype=dtype, generator=torch.Generator().manual_seed(0))
    return relative_shift(per_distance, keys)


def test_a_diagonal_view_is_copied_aligned_with_equal_values():
    for queries, keys, dtype in [(40, 40, torch.bfloat16), (512, 512, torch.bfloat16), (7, 9, torch.float32),
                                 (5, 16, torch.float16)]:
        view = diagonal_view(queries, keys, dtype)
        assert not is_aligned(view)  # the case this guards: else the test could not fail
        aligned = aligned_mask(view)
        assert is_aligned(aligned), (queries, keys, dtype, aligned.stride(), aligned.storage_offset())
        assert aligned.shape == view.shape and torch.equal(aligned, view)


def test_an_aligned_mask_and_a_broadcast_one_are_passed_as_they_are():
    contiguous = torch.randn(2, 3, 5, 16)
    assert aligned_mask(contiguous) is contiguous
    per_head = torch.randn(3, 5, 8, dtype=torch.bfloat16)[None]  # (1, H, Tq, Tk): batch broadcast
    assert aligned_mask(per_head) is per_head


def test_a_contiguous_view_with_an_unaligned_start_is_copied():
    buffer = torch.randn(1 + 4 * 16)
    view = buffer[1:].view(1, 1, 4, 16)  # strides aligned, start one element in
    assert view.is_contiguous() and not is_aligned(view)
    aligned = aligned_mask(view)
    assert is_aligned(aligned) and torch.equal(aligned, view)


def test_the_gradient_reaches_the_terms_through_the_copy():
    per_distance = torch.randn(2, 3, 6, 6 + 9 - 1, requires_grad=True)
    upstream = torch.randn(2, 3, 6, 9)
    (expected,) = torch.autograd.grad(relative_shift(per_distance, 9), per_distance, upstream)
    (got,) = torch.autograd.grad(aligned_mask(relative_shift(per_distance, 9)), per_distance, upstream)
    assert torch.equal(got, expected)
