"""Decoding steps: per-step position work once per step (shared by the layers), no host
synchronisation beyond the stock model's, and values kept across steps in inference
(`encodings/cache.py`) that follow every change of the parameters."""
import copy

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.encodings.cache import range_values
from posenc_fairseq.encodings.positions import bounds
from devices import bound, on
from position_terms import position_range
from test_every_encoding import decoder_logits_full_and_stepwise, perturb_away_from_identity, perturbed_translation_model
from util import TINY_TRANSFORMER, build_model, random_batch

STEP_ENCODINGS = ["t5", "t5_nob", "at5", "at5_nob", "alibi", "rotary", "shaw", "lfhc", "xl", "gcdf"]


def test_range_values_slices_grows_and_follows_the_parameters(monkeypatch):
    from posenc_fairseq.encodings import cache as cache_module

    monkeypatch.setattr(cache_module, "KEPT_MARGIN", 0)  # (the margin: next test)
    computed = []

    def compute(low, high):
        computed.append((low, high))
        return torch.arange(low, high + 1, dtype=torch.float64)[None, :] * scale

    cache, scale = {}, 1.0
    assert range_values(cache, "k", ("a",), 0, 3, compute, dim=1).tolist() == [[0, 1, 2, 3]]
    assert range_values(cache, "k", ("a",), 1, 2, compute, dim=1).tolist() == [[1, 2]]  # a slice
    assert computed == [(0, 3)]
    assert range_values(cache, "k", ("a",), -1, 3, compute, dim=1).tolist() == [[-1, 0, 1, 2, 3]]
    assert computed[-1] == (-4, 3)  # doubled on the missing side only
    assert range_values(cache, "k", ("a",), -4, 0, compute, dim=1).tolist() == [[-4, -3, -2, -1, 0]]
    assert len(computed) == 2
    scale = 2.0  # what the values are computed from changed: its key differs
    assert range_values(cache, "k", ("b",), 0, 1, compute, dim=1).tolist() == [[0, 2]]
    assert computed[-1] == (0, 1)


def test_a_new_kept_range_starts_with_a_margin_on_each_side():
    """A pass's first decoding step keeps KEPT_MARGIN more distances on each side, so the next
    steps (one more distance each) are slices."""
    from posenc_fairseq.encodings.cache import KEPT_MARGIN

    computed = []

    def compute(low, high):
        computed.append((low, high))
        return torch.arange(low, high + 1, dtype=torch.float64)

    cache = {}
    for step in range(KEPT_MARGIN + 1):  # XL's distances 0..step of a decoding step
        assert range_values(cache, "k", ("a",), 0, step, compute, dim=0).tolist() == list(range(step + 1))
    assert computed == [(-KEPT_MARGIN, KEPT_MARGIN)]


def test_what_is_derived_from_a_slice_is_kept_with_its_range(monkeypatch):
    """`derive` runs once per (low, high) while the kept range holds (the next decode's steps find
    their terms made) and again once the range is recomputed: nothing keeps an old range alive."""
    from posenc_fairseq.encodings import cache as cache_module

    monkeypatch.setattr(cache_module, "KEPT_MARGIN", 0)
    derived = []

    def derive(values):
        derived.append(values.tolist())
        return list(values.tolist())

    def compute(low, high):
        return torch.arange(low, high + 1, dtype=torch.float64)

    cache = {}
    first = range_values(cache, "k", ("a",), -3, 0, compute, dim=0, derive=derive)
    assert first == [-3, -2, -1, 0] and derived == [first]
    assert range_values(cache, "k", ("a",), -3, 0, compute, dim=0, derive=derive) is first  # kept
    assert range_values(cache, "k", ("a",), -2, 0, compute, dim=0, derive=derive) == [-2, -1, 0]
    assert len(derived) == 2
    assert range_values(cache, "k", ("a",), -5, 0, compute, dim=0, derive=derive) == [-5, -4, -3, -2, -1, 0]
    assert range_values(cache, "k", ("a",), -3, 0, compute, dim=0, derive=derive) is not first  # range recomputed
    assert len(derived) == 4
    assert range_values(cache, "k", ("b",), -3, 0, compute, dim=0, derive=derive) == first  # key changed
    assert len(derived) == 5


def test_position_range_knows_its_bounds():
    positions = position_range(3, 7)
    assert positions.tensor.tolist() == [3, 4, 5, 6] and bounds(positions) == (3, 6)
    assert bounds(torch.tensor([5, 2, 9])) == (2, 9)


@pytest.mark.parametrize("encoding", ["t5", "at5", "xl", "gcdf", "shaw", "lfhc"])
def test_kept_values_outlive_a_pass_while_the_parameters_hold_their_values(translation_data, device, encoding,
                                                                            monkeypatch):
    """The second decode of the same model computes no per-distance values (checked by value at
    its first step); after a write through p.data (as fairseq's optimizers do: no version moves)
    the next decode computes them again and equals the full pass."""
    from posenc_fairseq.encodings import cache, shaw, t5, xl

    model, task = perturbed_translation_model(translation_data, encoding, device)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=6, tgt_len=9))
    computed = []
    original = cache.range_values

    def counting(cache, key, depends_on, low, high, compute, *args, **kwargs):
        return original(cache, key, depends_on, low, high,
                        lambda a, b: computed.append(key) or compute(a, b), *args, **kwargs)
    for module in (t5, xl, shaw):
        monkeypatch.setattr(module, "range_values", counting)
    with torch.no_grad():
        decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        assert computed
        computed.clear()
        decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        assert computed == []
        for parameter in model.positional_encoding.parameters():
            parameter.data.mul_(1.5)
        full, stepwise = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
    assert computed and (full - stepwise).abs().max() <= bound(device, "steps vs pass")


@pytest.mark.parametrize("encoding", STEP_ENCODINGS)
def test_steps_follow_parameter_changes(translation_data, device, encoding):
    """Decode, change every parameter in place, decode again: the kept per-distance values
    (T5/AT5 bias, XL/GCDF projected prior) are recomputed, steps equal the full pass both times."""
    limit = bound(device, "steps vs pass")
    model, task = perturbed_translation_model(translation_data, encoding, device)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=6, tgt_len=9))
    with torch.no_grad():
        full, stepwise = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        assert (full - stepwise).abs().max() <= limit
        for parameter in model.positional_encoding.parameters():
            parameter.mul_(1.5).add_(0.05)
        full_2, stepwise_2 = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
    assert (full_2 - stepwise_2).abs().max() <= limit
    if list(model.positional_encoding.parameters()):  # ALiBi and rotary have none
        assert (full_2 - full).abs().max() > 1e-3


@pytest.mark.parametrize("encoding", ["at5", "xl", "gcdf"])
def test_kept_values_follow_a_change_of_dtype(translation_data, device, encoding):
    """Decode in float32, turn the model into float64 (model.double()), decode again: the values
    kept by the float32 decode are not used (steps equal the full pass in float64 and a copy made
    float64 before any decode). The encodings whose kept values are computed (T5's and Shaw's are
    rows of a table, the same numbers in either dtype). (float64's rounding: the same bound on CUDA.)"""
    model, task = perturbed_translation_model(translation_data, encoding, device)
    fresh = copy.deepcopy(model).double()
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=6, tgt_len=9))
    with torch.no_grad():
        decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        full, stepwise = decoder_logits_full_and_stepwise(model.double(), src, src_lengths, prev)
        reference, _ = decoder_logits_full_and_stepwise(fresh, src, src_lengths, prev)
    assert stepwise.dtype == torch.float64
    assert (full - stepwise).abs().max() <= 1e-10
    assert (reference - stepwise).abs().max() <= 1e-10


@pytest.mark.parametrize("encoding", ["at5", "at5_nob", "xl", "gcdf"])
def test_kept_values_follow_autocast(translation_data, encoding):
    """Decode under bf16 autocast, then without it: the values that decode kept (AT5's MLP and XL's
    projections run in bf16 under autocast, their results float32 again) are not used, and the full pass
    and the steps equal a copy that never ran under autocast. Before, they differed by 4e-3 to 6e-2."""
    model, task = perturbed_translation_model(translation_data, encoding)
    fresh = copy.deepcopy(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=6, tgt_len=9)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        full, stepwise = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        reference_full, reference_steps = decoder_logits_full_and_stepwise(fresh, src, src_lengths, prev)
    assert torch.equal(full, reference_full) and torch.equal(stepwise, reference_steps)


@pytest.mark.parametrize("encoding,name,value", [
    ("t5", "max_distance", 17),
    ("t5", "num_buckets", 16),
    ("at5", "length_scale", 4.0),
    ("at5_nob", "length_scale", 4.0),
    ("gcdf", "scale", 2.0),
])
def test_kept_values_follow_the_options_they_were_computed_with(translation_data, encoding, name, value):
    """An option the position term reads changed on a built model (T5's M and bucket count, AT5's L,
    GCDF's lambda): the next decode recomputes the kept values, as a copy changed before any decode
    does (the model then computes something else)."""
    model, task = perturbed_translation_model(translation_data, encoding)
    # (T5's buckets below 16 are exact whatever M is: longer targets)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=6, tgt_len=24)
    with torch.no_grad():
        before = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        fresh = copy.deepcopy(model)
        for changed in (model, fresh):
            setattr(changed.positional_encoding, name, value)
        after = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
        reference = decoder_logits_full_and_stepwise(fresh, src, src_lengths, prev)
    assert all(torch.equal(a, r) for a, r in zip(after, reference))
    assert (after[1] - before[1]).abs().max() > 1e-3


@pytest.mark.parametrize("encoding", ["t5", "xl", "alibi", "shaw"])
def test_interleaved_decodes_with_cross_self_attention(translation_data, encoding):
    """Two decodes step by step in turn, each with its own incremental state, sources of different
    lengths (--cross-self-attention: the decoder's self-attention keys are the source, then the
    target): each equals its full pass. A later step counts its source keys in its own cached keys;
    before, it took the length of whichever decode had made the last first step (off by up to 0.24,
    or "keys cannot hold")."""
    torch.manual_seed(0)
    model, task, _ = build_model(translation_data, f"transformer_{encoding}", [*TINY_TRANSFORMER, "--cross-self-attention"])
    model.eval()
    perturb_away_from_identity(model)
    batches = [random_batch(task.source_dictionary, batch=2, src_len=length, tgt_len=5, seed=seed)
               for length, seed in ((11, 1), (6, 2))]
    with torch.no_grad():
        encoder_outs = [model.encoder(src, src_lengths=src_lengths) for src, src_lengths, _ in batches]
        fulls = [model.decoder(prev, encoder_out=out)[0] for (_, _, prev), out in zip(batches, encoder_outs)]
        states, steps = [{}, {}], [[], []]
        for t in range(5):
            for index in (1, 0):
                prev = batches[index][2]
                steps[index].append(model.decoder(prev[:, : t + 1], encoder_out=encoder_outs[index],
                                                  incremental_state=states[index])[0])
    for full, stepwise in zip(fulls, steps):
        assert (full - torch.cat(stepwise, dim=1)).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", STEP_ENCODINGS)
def test_no_host_synchronisation_per_layer_in_a_step(translation_data, device, encoding, monkeypatch):
    """int(tensor) / tensor.item() wait for the device on CUDA: a decoding step of any encoding
    makes no more of them than the stock sinusoidal model's step (none per layer), on the device."""
    counts = {}
    for name in ("sinusoidal", encoding):
        model, task = perturbed_translation_model(translation_data, name, device)
        src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=6, tgt_len=5))
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=src_lengths)
            state = {}
            model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state=state)
            calls = []
            with monkeypatch.context() as patch:
                for method in ("__int__", "__index__", "item", "tolist", "__bool__", "__float__"):
                    original = getattr(torch.Tensor, method)
                    patch.setattr(torch.Tensor, method,
                                  lambda self, *a, _m=method, _o=original: (calls.append(_m), _o(self, *a))[1])
                for t in range(1, prev.size(1)):
                    model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        counts[name] = len(calls)
    assert counts[encoding] <= counts["sinusoidal"], counts
