"""Which table FLOATER's forward pass reads (table.py): the K-update window's, an extended table equal to
a fresh solve, the evaluation table tied to the options and to every tensor it is solved from and
reused across decoding steps, and clear failure where the biases overflow the model's dtype."""
import copy
import math

import pytest
import torch

from devices import on
from floater_util import counting_solves, floater_model, model_gradients, perturb
from posenc_fairseq.encodings import cache as cache_module
from util import random_batch


def test_gradients_with_the_k_update_window(translation_data, device, monkeypatch):
    model, task, encoding = floater_model(translation_data, ["--floater-recompute-every", "3", "--dropout", "0"])
    model.train()
    perturb(model)
    model.to(device)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8))
    calls = counting_solves(monkeypatch)
    model.set_num_updates(0)
    theta, b0 = model_gradients(model, encoding, src, src_lengths, prev)  # first pass of the window: solves
    assert len(calls) == 1 and all(g.abs().sum() > 0 for g in theta) and all(g.abs().sum() > 0 for g in b0)
    window_table = encoding.tables.window.table.values.clone()
    for update in (1, 2):
        model.set_num_updates(update)
        theta, b0 = model_gradients(model, encoding, src, src_lengths, prev)  # reuses the window's table
        assert len(calls) == 1
        assert all(g is not None and g.abs().sum() == 0 for g in theta)  # in the graph, zero gradient
        assert all(g.abs().sum() > 0 for g in b0)  # directly, as the Linear bias
    # a longer batch inside the window: extended from the window's parameter snapshot, not re-solved
    with torch.no_grad():
        for p in encoding.dynamics.parameters():
            p.add_(0.05)  # what an optimizer step would do; the window's table must not follow
    src2, len2, prev2 = on(device, *random_batch(task.source_dictionary, batch=2, src_len=30, tgt_len=8))
    model_gradients(model, encoding, src2, len2, prev2)
    assert len(calls) == 2 and encoding.tables.window.table.values.size(0) >= 30
    assert torch.equal(encoding.tables.window.table.values[: window_table.size(0)], window_table)
    model.set_num_updates(3)
    theta, _ = model_gradients(model, encoding, src, src_lengths, prev)  # a new window: solves with gradient
    assert len(calls) == 3 and all(g.abs().sum() > 0 for g in theta)


@pytest.mark.parametrize("update", [0, 4])  # the first window's first update, and a later window's
def test_every_pass_of_a_windows_first_update_solves_with_gradient(translation_data, monkeypatch, update):
    """--update-freq 2 makes two forward passes per update where two processes make one each: at a
    window's first update both passes solve with gradient, so h's accumulated gradient is K = 1's, as with
    two processes (before, only the first pass solved; the second gave h none, 0.80 against 1.54 in norm).
    At the window's later updates every pass reuses its table (h: zero gradient)."""
    batches = [random_batch(floater_model(translation_data)[1].source_dictionary, batch=2, src_len=src_len,
                            tgt_len=6, seed=seed) for seed, src_len in ((0, 9), (1, 12))]

    def accumulated(recompute_every, at_update):
        model, _, encoding = floater_model(translation_data, ["--floater-recompute-every", str(recompute_every),
                                                              "--dropout", "0"])
        model.train()
        perturb(model)
        model.set_num_updates(update)
        if at_update != update:  # the window's first update is over (its table, long enough, was solved then)
            model(*batches[1])
            model.zero_grad()
            model.set_num_updates(at_update)
        for src, src_lengths, prev in batches:  # one update's two micro-batches, gradients accumulated
            logits, _ = model(src, src_lengths, prev)
            logits.float().logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in encoding.dynamics.parameters()]

    calls = counting_solves(monkeypatch)
    every_update = accumulated(1, update)
    assert len(calls) == 2
    windowed = accumulated(3, update)
    assert len(calls) == 4  # each micro-batch solved, from the same parameters
    for ours, reference in zip(windowed, every_update):
        assert (ours - reference).abs().max() <= 1e-6 * reference.abs().max()
    later = accumulated(3, update + 1)  # the window goes on: its table, h in the graph with zero gradient
    assert len(calls) == 5 and all(g.abs().sum() == 0 for g in later)


def test_biases_beyond_the_cache_equal_a_fresh_solve(translation_data):
    model, _, encoding = floater_model(translation_data)
    model.eval()
    perturb(model)
    with torch.no_grad():
        short = encoding.table(20).clone()
        assert short.size(0) == 64
        longer = encoding.table(150)  # integrated onward from position 63
        assert longer.size(0) == 192 and torch.equal(longer[:64], short)
        fresh = encoding.solve(192)
    assert (longer - fresh).abs().max() <= 1e-5
    assert (longer[64:] - longer[63]).abs().max() > 1e-2


def test_evaluation_table_is_tied_to_options_parameters_and_reused_across_steps(translation_data, monkeypatch):
    model, task, encoding = floater_model(translation_data)
    model.eval()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=12, tgt_len=9)
    calls = counting_solves(monkeypatch)
    with torch.no_grad():
        first, _ = model(src, src_lengths, prev)
        again, _ = model(src, src_lengths, prev)
        assert len(calls) == 1 and torch.equal(first, again)  # cached across passes
        # incremental decoding: no solve, and no parameter check after the first step
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        checks = []  # (checks of the kept table against the parameters)
        monkeypatch.setattr(cache_module, "same_values",
                            lambda *args, original=cache_module.same_values: checks.append(1) or original(*args))
        state = {}
        for t in range(prev.size(1)):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        assert len(calls) == 1 and len(checks) <= 1
        # every solver option the table depends on: a changed option re-solves
        for name, value in (("delta", 0.2), ("substeps", 2), ("method", "midpoint")):
            setattr(encoding, name, value)
            changed, _ = model(src, src_lengths, prev)
            assert (changed - first).abs().max() > 1e-4, name
        encoding.delta, encoding.substeps, encoding.method = 0.1, 5, "rk4"
        back, _ = model(src, src_lengths, prev)
        assert torch.equal(back, first)
        # and h's form (the bounded-flow options): a changed form re-solves, the old one comes back
        for name, value in (("stop_time", 0.35), ("max_speed", 0.01), ("autonomous", True)):
            setattr(encoding.dynamics, name, value)
            changed, _ = model(src, src_lengths, prev)
            assert (changed - first).abs().max() > 1e-4, name
            setattr(encoding.dynamics, name, None if name != "autonomous" else False)
            assert torch.equal(model(src, src_lengths, prev)[0], first), name
        # fairseq-style in-place parameter update (p.data) is seen
        encoding.dynamics.fc1.bias.data.add_(0.1)
        moved, _ = model(src, src_lengths, prev)
        assert (moved - first).abs().max() > 1e-4


def test_evaluation_table_follows_every_tensor_it_is_solved_from(translation_data, monkeypatch):
    """The evaluation table is checked by value against the tensors it was solved from, once per
    pass: an in-place change of h or of b(0), also of a head-pruned layer's kept heads (whose full
    b(0) is a new tensor at every call), or a replaced tensor, re-solves to what a fresh solve
    gives; a replaced tensor with the same values does not. (fairseq's optimizers write through
    p.data: test_workflows checks that after a real update.)"""
    model, task, encoding = floater_model(translation_data)
    model.eval()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=12, tgt_len=9)
    calls = counting_solves(monkeypatch)

    def fresh():  # the reference: every kept table forgotten
        encoding._forget_tables()
        return model(src, src_lengths, prev)[0]

    with torch.no_grad():
        first = model(src, src_lengths, prev)[0]
        fc1 = encoding.dynamics.fc1.weight
        fc1.data = fc1.data.clone()  # new storage, same values: checked once, kept
        assert torch.equal(model(src, src_lengths, prev)[0], first) and len(calls) == 1
        attention = model.encoder.layers[0].self_attn
        d = attention.head_dim
        attention._adaptive_prune_heads([(0, d), (2 * d, 3 * d)])
        attention._set_skip_embed_dim_check()
        model(src, src_lengths, prev)
        changes = {
            "pruned layer's kept q bias": lambda: attention.q_proj.bias.add_(0.1),
            "cross-attention v bias": lambda: model.decoder.layers[0].encoder_attn.v_proj.bias.mul_(2),
            "h replaced": lambda: setattr(encoding.dynamics.fc2.weight, "data", encoding.dynamics.fc2.weight.data * 1.5),
        }
        for name, change in changes.items():
            before = model(src, src_lengths, prev)[0]
            solves = len(calls)
            change()
            after = model(src, src_lengths, prev)[0]
            assert len(calls) == solves + 1, name
            assert (after - before).abs().max() > 1e-4 and torch.equal(after, fresh()), name


def exploding(model, encoding):
    """An h that grows b(t) exponentially (db/dt = 3 b): overflows fp32 by position ~300."""
    with torch.no_grad():
        perturb(model, scale=0.5)
        dim = encoding.dims.embed_dim
        encoding.dynamics.fc1.weight.zero_()
        encoding.dynamics.fc1.weight[:dim, :dim] = torch.eye(dim)
        encoding.dynamics.fc1.bias.fill_(10.0)
        encoding.dynamics.fc2.weight.zero_()
        encoding.dynamics.fc2.weight[:, :dim] = 3 * torch.eye(dim)


@pytest.mark.parametrize("dtype,limit", [(torch.float32, 400), (torch.float16, 60)])
def test_overflowing_biases_fail_with_a_message_naming_the_position(translation_data, device, dtype, limit):
    model, task, encoding = floater_model(translation_data, ["--max-source-positions", "2048"])
    model.eval()
    exploding(model, encoding)
    model.to(device, dtype)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=1, src_len=8, tgt_len=8))
    with torch.no_grad():
        short, _ = model(src, src_lengths, prev)  # short inputs stay fine
        assert torch.isfinite(short).all()
        src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=1, src_len=limit, tgt_len=8))
        with pytest.raises(ValueError, match=r"FLOATER position biases overflow at position \d+ .*--floater-delta"):
            model(src, src_lengths, prev)


def test_biases_float32_holds_whose_products_overflow_fail_too(translation_data):
    """A bias float32 still holds can make the attention's products of two biases infinite: an audit
    found NaN outputs there (leaking to earlier positions through masked keys), no error. The limit is
    sqrt(float32 max / d): an input that reaches a bias beyond it fails with the message, one just
    before it runs finite."""
    model, task, encoding = floater_model(translation_data, ["--max-source-positions", "2048"])
    model.eval()
    exploding(model, encoding)
    peaks = encoding.table(400).abs().flatten(1).amax(dim=1)
    limit = math.sqrt(torch.finfo(torch.float32).max / encoding.dims.embed_dim)
    first = int((peaks > limit).nonzero()[0, 0])
    assert bool(peaks[first] < torch.finfo(torch.float32).max)  # float32 holds the bias itself
    with torch.no_grad():
        fine, _ = model(*random_batch(task.source_dictionary, batch=1, src_len=first, tgt_len=8))
        assert torch.isfinite(fine).all()
        message = f"overflow at position {first} .*more than the {limit:.3g} a torch.float32 model's attention takes"
        with pytest.raises(ValueError, match=message.replace("+", r"\+")) as refusal:
            model(*random_batch(task.source_dictionary, batch=1, src_len=first + 1, tgt_len=8))
    # the way out the message gives for a trained model: its flow stopped before that position
    hint = f"--model-overrides \"{{'floater_stop_position': N}}\", N below {first}"
    assert hint in str(refusal.value)
    stopped, _, _ = floater_model(translation_data, ["--max-source-positions", "2048",
                                                     "--floater-stop-position", str(first - 1)])
    stopped.load_state_dict(model.state_dict())
    stopped.eval()
    with torch.no_grad():
        assert torch.isfinite(stopped(*random_batch(task.source_dictionary, batch=1, src_len=first + 1,
                                                    tgt_len=8))[0]).all()


@pytest.mark.parametrize("recompute_every", [1, 3])
def test_an_overflow_in_training_is_named_by_the_next_pass(translation_data, device, recompute_every):
    """In training the table's overflow check is read by the next pass (`OverflowCheck`: no host read
    while the solve runs): the pass whose table overflowed runs on with a loss that is not finite
    (which fairseq's trainer skips or stops on), and the next pass, whatever its input, raises the
    message naming the position. The K-window's overflowed table is not reused after: the next long
    pass solves again, and is named again by the pass after it."""
    model, task, encoding = floater_model(
        translation_data, ["--max-source-positions", "2048", "--floater-recompute-every", str(recompute_every)])
    exploding(model, encoding)
    model.to(device).eval()
    peaks = encoding.table(400).abs().flatten(1).amax(dim=1)  # (the evaluation table)
    # the products of two biases over d coordinates must stay finite in float32
    expected = int((~(peaks <= math.sqrt(torch.finfo(torch.float32).max / encoding.dims.embed_dim))).nonzero()[0, 0])
    assert 8 < expected < 400
    model.train()
    short = on(device, *random_batch(task.source_dictionary, batch=1, src_len=8, tgt_len=8))
    long = on(device, *random_batch(task.source_dictionary, batch=1, src_len=400, tgt_len=8))
    model.set_num_updates(0)
    for attempt in range(2):
        output, _ = model(*short)
        output.float().sum().backward()
        assert torch.isfinite(output).all()
        output, _ = model(*long)  # the table overflows: this pass does not wait to find out
        assert not torch.isfinite(output).all()
        with pytest.raises(ValueError, match=rf"overflow at position {expected} .*in an earlier training pass, "
                                             r"for an input of 400 positions: .*--floater-delta"):
            model(*short)


def test_decoding_steps_into_the_overflow_fail_with_the_message(translation_data, device):
    """Step-by-step decoding of a model whose biases overflow fp16 near position 60: every step
    before runs, the step at the first position fp16 cannot hold fails with the message (the later
    steps' kept rows stop short of it). (Its outputs may overflow earlier: biases near fp16's limit.)"""
    model, task, encoding = floater_model(translation_data, ["--max-target-positions", "2048"])
    model.eval()
    exploding(model, encoding)
    model.to(device).half()
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=1, src_len=8, tgt_len=100))
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state, steps = {}, 0
        with pytest.raises(ValueError, match=r"FLOATER position biases overflow at position (\d+) "):
            for t in range(prev.size(1)):
                model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
                steps += 1
    # independently: the first position whose b(t) - b(0), solved in fp32, fp16 cannot hold
    peaks = encoding.table(100).abs().flatten(1).amax(dim=1)
    first_overflow = int((peaks > torch.finfo(torch.float16).max).nonzero()[0, 0])
    assert 8 < steps == first_overflow < 100  # every position fp16 holds was decoded


def test_the_table_outside_a_pass_follows_an_optimizer_step(translation_data):
    """`Floater.table` between training passes: the parameters' table as they are after the step
    (the evaluation table), not the last pass's, which was solved before it (before: 0.058 apart)."""
    model, task, encoding = floater_model(translation_data)
    perturb(model)
    model.train()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    output, _ = model(src, src_lengths, prev)
    output.float().logsumexp(-1).mean().backward()
    optimizer.step()
    table = encoding.table(10)
    assert not table.requires_grad and model.training
    with torch.no_grad():
        assert torch.equal(table, encoding.solve(64))  # (the evaluation table: chunks of 64 positions)
        assert (table[:10] - encoding.solve(10)).abs().max() <= 1e-6


@pytest.mark.parametrize("change", ["in place", "replaced", "optimizer step"])
@pytest.mark.parametrize("grad", [True, False])
def test_a_decoder_call_after_a_parameter_change_solves_from_the_live_parameters(translation_data, change, grad):
    """The decoder reading the encoder's output continues the encoder's model pass, and its table;
    a change of h or of the biases in between (an optimizer step, a load, a replaced Parameter) makes
    that table stale. Reference: a copy taken before any forward, changed alike, whose decoder is
    given the same encoder output (before: the change was ignored, 2.4 apart)."""
    model, task, encoding = floater_model(translation_data, ["--dropout", "0"])
    perturb(model)
    model.train()
    fresh = copy.deepcopy(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8)
    optimizers = {}
    for target in (model, fresh):
        if change == "optimizer step":  # (gradients of the same batch on both, before the encoder's call)
            optimizers[id(target)] = torch.optim.SGD(target.parameters(), lr=5.0)
            target(src, src_lengths, prev)[0].float().logsumexp(-1).mean().backward()

    def change_parameters(target):
        dynamics, bias = target.positional_encoding.dynamics, target.decoder.layers[0].self_attn.q_proj.bias
        if change == "in place":
            with torch.no_grad():
                dynamics.fc2.bias.add_(0.5)
                bias.add_(0.5)
        elif change == "replaced":
            dynamics.fc2.bias = torch.nn.Parameter(dynamics.fc2.bias.detach() + 0.5)
        else:
            optimizers[id(target)].step()

    with torch.set_grad_enabled(grad):
        encoder_out = model.encoder(src, src_lengths)
        change_parameters(model)
        change_parameters(fresh)
        found = model.decoder(prev, encoder_out=encoder_out)[0]
        expected = fresh.decoder(prev, encoder_out=encoder_out)[0]
    assert (found - expected).abs().max() <= 1e-6


def test_an_overflowed_window_table_is_not_reused_by_a_later_update_of_its_window(translation_data):
    """K = 3: the pass whose table overflowed is named by the next pass, and the window (whose table that
    was) is dropped: at the window's next update a long pass solves again, not reading the overflowed table
    unchecked, so the pass after it names the overflow again."""
    model, task, encoding = floater_model(translation_data, ["--max-source-positions", "2048",
                                                             "--floater-recompute-every", "3"])
    exploding(model, encoding)
    model.train()
    short = random_batch(task.source_dictionary, batch=1, src_len=8, tgt_len=8)
    long = random_batch(task.source_dictionary, batch=1, src_len=400, tgt_len=8)
    for update in (0, 1):  # the window's first update, then a later one
        model.set_num_updates(update)
        output, _ = model(*long)
        assert not torch.isfinite(output).all()
        with pytest.raises(ValueError, match=r"overflow at position .*in an earlier training pass, for an input of "
                                             r"400 positions"):
            model(*short)
