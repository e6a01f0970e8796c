"""Mixed precision, every encoding: training under torch.autocast (fairseq's --amp) and in bf16 / fp16
models (--bf16 / --fp16: model.bfloat16() / model.half()) against the same weights in fp32: the loss,
which parameters get gradients, and the encoding's own parameters' gradients (relative to their norm)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from posenc_fairseq.encodings import ENCODINGS
from devices import bound, on
from test_every_encoding import perturb_away_from_identity
from util import TINY_TRANSFORMER, build_model, random_batch

EVERY_ENCODING = sorted(ENCODINGS)
ENCODING_PARAMETERS = "positional_encoding."

# The bounds, relative to fp32 (loss; the encoding's parameters' gradients as one vector), are
# devices.BOUNDS' "half ..." and "autocast ...": on the CPU each about 2-3x the largest difference
# measured over the encodings on this batch. bf16 keeps 8 significant bits, fp16 11; gradients that
# mostly cancel (GCDF's all-positive prior, T5/AT5's per-bucket sums of the logits' gradients) differ most.
FP16_LOSS_SCALE = 128.0
SMALL_GRADIENT = 1e-3  # fairseq's --fp16 starts its dynamic loss scale at 2^7
#: encodings without parameters of their own (fixed functions, or the stock embedding table): they have
#: no encoding gradient to compare, and the tests check that there is none
WITHOUT_PARAMETERS = {"alibi", "learned", "nope", "rotary", "sinusoidal"}


def training_setup(data, encoding, device="cpu"):
    """Tiny transformer_{encoding} on `device` in training mode without dropout (runs compare exactly),
    its encoding moved away from identity, and a padded batch (left-padded source) with targets."""
    torch.manual_seed(0)
    model, task, _ = build_model(data, f"transformer_{encoding}", [*TINY_TRANSFORMER, "--dropout", "0"])
    model.train()
    perturb_away_from_identity(model)
    dictionary = task.source_dictionary
    src, src_lengths, prev = random_batch(dictionary, batch=3, src_len=9, tgt_len=7)
    target = torch.randint(dictionary.nspecial, len(dictionary), prev.shape, generator=torch.Generator().manual_seed(2))
    return model.to(device), on(device, src, src_lengths, prev), target.to(device)


def loss_and_gradients(model, batch, target, autocast=None, loss_scale=1.0):
    """Cross-entropy (computed in fp32, as fairseq's criterion does under --amp) and every
    parameter's gradient in fp32, unscaled; forward under autocast to `autocast` (on the batch's
    device) if given."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(target.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits, _ = model(*batch)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))
    (loss * loss_scale).backward()
    gradients = {name: p.grad.float() / loss_scale for name, p in model.named_parameters() if p.grad is not None}
    return float(loss), gradients


def relative_difference(got, expected, prefix=""):
    """|got - expected| / |expected| of the gradients whose names start with `prefix`, all of them
    as one vector (None if there are none). (Per tensor, a gradient that cancels to almost nothing,
    e.g. a key projection's bias, which softmax ignores, keeps the half-precision error of the
    terms that cancel: larger than itself.)"""
    names = [name for name in expected if name.startswith(prefix)]
    if not names:
        return None
    difference = torch.cat([(got[name] - expected[name]).reshape(-1) for name in names])
    return float(difference.norm() / torch.cat([expected[name].reshape(-1) for name in names]).norm())


def assert_encoding_gradients_close(got, expected, encoding, bound):
    """The encoding's own parameters' gradients (as one vector) within `bound` of fp32's, relative;
    an encoding of WITHOUT_PARAMETERS has none, and must have none."""
    difference = relative_difference(got, expected, ENCODING_PARAMETERS)
    if encoding in WITHOUT_PARAMETERS:
        assert difference is None, f"{encoding} has parameters of its own now: take it out of WITHOUT_PARAMETERS"
    else:
        assert difference is not None and difference <= bound, (encoding, difference)


def test_without_parameters_lists_exactly_the_encodings_without_parameters():
    from posenc_fairseq.encodings import ModelDims, build_encoding
    from util import encoding_options

    built = {name: build_encoding(name, encoding_options(), ModelDims(32, 4, 2, 2)) for name in EVERY_ENCODING}
    assert WITHOUT_PARAMETERS == {name for name, encoding in built.items() if not list(encoding.parameters())}


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_trains_under_autocast_close_to_fp32(translation_data, device, encoding, dtype):
    """torch.autocast to `dtype` on the device (fp16: CUDA only, fairseq's --amp there)."""
    loss_limit, gradient_limit = bound(device, "autocast loss", dtype), bound(device, "autocast gradients", dtype)
    model, batch, target = training_setup(translation_data, encoding, device)
    reference_loss, reference = loss_and_gradients(model, batch, target)
    scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
    loss, gradients = loss_and_gradients(model, batch, target, autocast=dtype, loss_scale=scale)
    assert abs(loss - reference_loss) <= loss_limit * reference_loss
    assert sorted(gradients) == sorted(reference)  # every parameter fp32 trains gets a gradient
    assert all(torch.isfinite(grad).all() for grad in gradients.values())
    assert_encoding_gradients_close(gradients, reference, encoding, gradient_limit)


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_gradients_close_to_fp32(translation_data, device, encoding, dtype):
    model, batch, target = training_setup(translation_data, encoding, device)
    reference_loss, reference = loss_and_gradients(model, batch, target)
    half = copy.deepcopy(model).to(dtype)
    scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
    loss, gradients = loss_and_gradients(half, batch, target, loss_scale=scale)
    assert abs(loss - reference_loss) <= bound(device, "half loss", dtype) * reference_loss
    assert sorted(gradients) == sorted(reference)
    assert all(torch.isfinite(grad).all() for grad in gradients.values())
    assert_encoding_gradients_close(gradients, reference, encoding, bound(device, "half gradients", dtype))


@pytest.mark.parametrize("encoding", ["t5", "t5_nob"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_table_sums_the_gradients_of_its_distances_in_float32(device, encoding, dtype):
    """Thousands of distances share T5's far buckets (T5-NoB's clipped rows): each table row's
    gradient sums theirs in float32, rounded once (a half-precision running sum of ones stops at 256
    (bf16) or 2048 (fp16); CUDA's scatter adds atomically in the tensor's dtype)."""
    from posenc_fairseq.encodings import ModelDims, build_encoding
    from util import encoding_options

    bias = build_encoding(encoding, encoding_options(), ModelDims(32, 4, 2, 2)).to(device, dtype)
    table = bias.tables["encoder"]
    low, high = -3000, 3000
    (grad,) = torch.autograd.grad(bias.distance_bias("encoder", low, high).sum(), table)
    rows = bias.rows_of(torch.arange(low, high + 1, device=device), bidirectional=True)
    distances_per_row = torch.bincount(rows, minlength=table.size(0)).to(torch.float64)
    assert distances_per_row.max() > 2048
    assert grad.dtype == dtype and torch.equal(grad, distances_per_row[:, None].expand_as(grad).to(dtype))


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_float64_model_equals_fp32_with_rows_that_see_no_key(translation_data, device, encoding):
    """In float64 (model.double()), a left-padded target puts decoder rows under the future mask that
    see only padding; the blocked fill (the dtype's finite minimum) must stay finite through softmax
    (a float32 softmax made it -inf: NaN rows, spreading to the whole sentence): every logit of both
    models is finite. The fp32 model on the device (its forward and backward: what CUDA's kernels
    change) against the float64 copy on the CPU: the loss over the rows that see a key, as fairseq's
    criterion counts them (a padded position's target is padding), every parameter's gradients and
    the encoding's own, equal to float32's precision. A row that sees no key has no right answer:
    the CPU gives it uniform weights, CUDA's fused kernels zero (fill x log2(e) overflows to -inf in
    their exp2; docs/gpu_check.md), and the loss leaves it out on both."""
    model, (src, src_lengths, prev), target = training_setup(translation_data, encoding)
    prev = prev.clone()
    pad = model.decoder.dictionary.pad()
    prev[1, :2] = pad  # row 1: two left pads, which see no key
    target = target.masked_fill(prev.eq(pad), -100)  # (F.cross_entropy's ignore_index)
    batch = (src, src_lengths, prev)
    reference = copy.deepcopy(model).double()
    model.to(device)
    with torch.no_grad():
        assert torch.isfinite(model(*on(device, *batch))[0]).all() and torch.isfinite(reference(*batch)[0]).all()
    expected_loss, expected = loss_and_gradients(model, on(device, *batch), target.to(device))
    expected = {name: gradient.cpu() for name, gradient in expected.items()}
    loss, gradients = loss_and_gradients(reference, batch, target)
    assert all(torch.isfinite(gradient).all() for gradient in gradients.values())
    assert sorted(gradients) == sorted(expected)
    assert abs(loss - expected_loss) <= bound(device, "float64 loss") * abs(expected_loss)
    gradient_limit = bound(device, "float64 gradients")
    assert relative_difference(gradients, expected) <= gradient_limit  # every parameter's, one vector
    assert_encoding_gradients_close(gradients, expected, encoding, gradient_limit)
