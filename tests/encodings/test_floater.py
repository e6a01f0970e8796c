"""FLOATER against hand-written references: a fixed-step RK4 / Euler loop of the same ODE, the
stock model (h == 0), a fresh solve (extension of a table), and fairseq's own training.
The fast integrator against torchdiffeq, precision, long inputs and checkpoint workflows are in
test_floater_solver.py and test_floater_workflows.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from posenc_fairseq.attention import PositionalAttention
from posenc_fairseq.encodings import floater as floater_module
from util import QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, build_model, random_batch, run


def floater_model(data, extra=(), arch="transformer_floater", task="translation"):
    torch.manual_seed(0)
    sizes = TINY_ROBERTA if arch.startswith("roberta") else TINY_TRANSFORMER
    model, task_obj, args = build_model(data, arch, [*sizes, *extra], task=task)
    return model, task_obj, model.positional_encoding


def perturb(model, scale=0.3, seed=1):
    """Move h away from zero and the projection biases away from their zero initialisation."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        parameters = list(model.positional_encoding.dynamics.parameters())
        parameters += [m.q_proj.bias for m in model.modules() if isinstance(m, PositionalAttention)]
        parameters += [m.k_proj.bias for m in model.modules() if isinstance(m, PositionalAttention)]
        parameters += [m.v_proj.bias for m in model.modules() if isinstance(m, PositionalAttention)]
        for parameter in parameters:
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def expected_slots(model):
    """(role, layer, which) -> b(0) Parameter, walked independently of the encoding."""
    slots = {}
    for index, layer in enumerate(model.encoder.layers):
        for which in "qkv":
            slots[("encoder", index, which)] = getattr(layer.self_attn, f"{which}_proj").bias
    for index, layer in enumerate(getattr(model, "decoder").layers if hasattr(model, "decoder") else []):
        for which in "qkv":
            slots[("decoder", index, which)] = getattr(layer.self_attn, f"{which}_proj").bias
            slots[("cross", index, which)] = getattr(layer.encoder_attn, f"{which}_proj").bias
    return slots


def make_h(dynamics):
    w1, c1 = dynamics.fc1.weight.detach(), dynamics.fc1.bias.detach()
    w2, c2 = dynamics.fc2.weight.detach(), dynamics.fc2.bias.detach()

    def h(t, b):  # the paper's h: Linear(d+1) - ReLU - Linear(hidden+1), time appended
        tau = torch.full((b.size(0), 1), t, dtype=b.dtype)
        hidden = torch.relu(torch.cat([b, tau], 1) @ w1.T + c1)
        return torch.cat([hidden, tau], 1) @ w2.T + c2

    return h


def reference_solve(h, b0, positions, delta, substeps, method):
    """b(i*delta) for i = 0..positions-1 by an explicit loop of fixed steps."""
    states, b = [b0], b0
    dt = delta / substeps
    for i in range(positions - 1):
        for s in range(substeps):
            t = i * delta + s * dt
            if method == "euler":
                b = b + dt * h(t, b)
            elif method == "rk4_38":  # Kutta's 3/8 rule: what torchdiffeq's 'rk4' computes
                k1 = h(t, b)
                k2 = h(t + dt / 3, b + dt * k1 / 3)
                k3 = h(t + 2 * dt / 3, b + dt * (k2 - k1 / 3))
                k4 = h(t + dt, b + dt * (k1 - k2 + k3))
                b = b + dt * (k1 + 3 * k2 + 3 * k3 + k4) / 8
            elif method == "rk4_classic":
                k1 = h(t, b)
                k2 = h(t + dt / 2, b + dt * k1 / 2)
                k3 = h(t + dt / 2, b + dt * k2 / 2)
                k4 = h(t + dt, b + dt * k3)
                b = b + dt * (k1 + 2 * k2 + 2 * k3 + k4) / 6
        states.append(b)
    return torch.stack(states)


def check_against_reference(translation_data, method, reference_methods, tolerance, extra=()):
    model, task, encoding = floater_model(translation_data, ["--floater-method", method, *extra])
    model.double().eval()
    perturb(model)
    slots = expected_slots(model)
    assert sorted(encoding._slot_index) == sorted(slots)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=12, tgt_len=9)
    positions = 12
    # through the projection_bias hook, for every slot: b(t_i) - b(0)
    index = torch.arange(positions)[None, :]
    encoding.begin("encoder", index)
    added = {key: encoding.projection_bias(*key, index)[:, 0] - slots[key].detach() for key in slots}
    h = make_h(encoding.dynamics)
    b0 = torch.stack([bias.detach() for bias in slots.values()])
    for reference_method in reference_methods:
        reference = reference_solve(h, b0, positions, encoding.delta, encoding.substeps, reference_method) - b0
        for row, key in enumerate(slots):
            assert (added[key] - reference[:, row]).abs().max() <= tolerance, (reference_method, key)
    assert max(value.abs().max() for value in added.values()) > 1e-2  # the biases really move
    return model, encoding


def test_rk4_biases_equal_a_hand_written_rk4_loop(translation_data):
    _, encoding = check_against_reference(translation_data, "rk4", ["rk4_38"], 1e-12)
    assert encoding.substeps == 5  # step delta/5
    # the classic RK4 tableau differs from the 3/8 rule only by the method's own error
    check_against_reference(translation_data, "rk4", ["rk4_classic"], 1e-3)


def test_euler_biases_equal_a_hand_written_euler_loop(translation_data):
    check_against_reference(translation_data, "euler", ["euler"], 1e-12,
                            ["--floater-delta", "0.2", "--floater-step-size", "0.05"])


def test_dopri5_and_midpoint_agree_with_rk4(translation_data):
    for method, tolerance in (("dopri5", 2e-3), ("midpoint", 2e-2)):  # midpoint is second order
        check_against_reference(translation_data, method, ["rk4_38"], tolerance)


def test_slots_first_block_only_and_model_output_uses_them(translation_data):
    model, task, encoding = floater_model(translation_data, ["--floater-first-block-only"])
    assert sorted(encoding._slot_index) == sorted(key for key in expected_slots(model) if key[1] == 0)
    assert encoding.initial_values().shape == (9, 32)


def test_zero_last_layer_is_exactly_the_stock_model(translation_data):
    model, task, encoding = floater_model(translation_data)
    model.eval()
    perturb(model)
    encoding.reset_to_identity()  # zero last layer, the rest of h stays random
    assert encoding.dynamics.fc1.weight.abs().sum() > 0
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    with torch.no_grad():
        ours, _ = model(src, src_lengths, prev)
        stock_model, _, _ = build_model(translation_data, "transformer", TINY_TRANSFORMER)
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("positional_encoding.")}
        stock_model.load_state_dict(state, strict=True)
        stock_model.eval()
        stock, _ = stock_model(src, src_lengths, prev)
        model.encoder.bind_encoding(None)
        model.decoder.bind_encoding(None)
        unbound, _ = model(src, src_lengths, prev)
    assert torch.equal(ours, unbound)  # bit for bit: the hook adds exact zeros
    # stock fairseq's MultiheadAttention sums in another order: equal up to rounding
    assert (ours - stock).abs().max() <= 1e-5


def gradients_of_table(encoding, rows=8):
    for p in [*encoding.dynamics.parameters(), *encoding.initial_parameters()]:
        p.grad = None
    table = encoding.solve(rows)
    (table * torch.linspace(-1, 1, table.numel()).view_as(table)).sum().backward()
    return [p.grad.clone() for p in encoding.dynamics.parameters()], [p.grad.clone() for p in encoding.initial_parameters()]


def test_gradients_reach_theta_and_every_initial_value_through_the_ode(translation_data):
    model, _, encoding = floater_model(translation_data)
    perturb(model)
    theta, b0 = gradients_of_table(encoding)
    assert all(g.abs().sum() > 0 for g in theta)
    assert all(g.abs().sum() > 0 for g in b0)  # through the ODE only: the table is b(t) - b(0)
    # the adjoint method gives the same gradients
    encoding.adjoint = True
    theta_adjoint, b0_adjoint = gradients_of_table(encoding)
    for plain, adjoint in zip(theta + b0, theta_adjoint + b0_adjoint):
        # the adjoint integrates a backward ODE: equal up to the solver's error, not bit for bit
        assert (plain - adjoint).norm() <= 2e-2 * plain.norm()


def model_gradients(model, encoding, src, src_lengths, prev):
    model.zero_grad()
    logits, _ = model(src, src_lengths, prev)
    (logits.float().log_softmax(-1)[..., 5].sum()).backward()
    return ([p.grad for p in encoding.dynamics.parameters()], [p.grad for p in encoding.initial_parameters()])


def counting_solves(monkeypatch):
    """Count the fixed-grid solves (each call of the fast integrator)."""
    calls = []
    original = floater_module.fixed_grid_solve

    def counting(*args):
        calls.append(args[2] - args[1] + 1)  # positions solved
        return original(*args)

    monkeypatch.setattr(floater_module, "fixed_grid_solve", counting)
    return calls


def test_gradients_with_the_k_update_window(translation_data, monkeypatch):
    model, task, encoding = floater_model(translation_data, ["--floater-recompute-every", "3", "--dropout", "0"])
    model.train()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8)
    calls = counting_solves(monkeypatch)
    model.set_num_updates(0)
    theta, b0 = model_gradients(model, encoding, src, src_lengths, prev)  # first pass of the window: solves
    assert len(calls) == 1 and all(g.abs().sum() > 0 for g in theta) and all(g.abs().sum() > 0 for g in b0)
    window_table = encoding._window["table"].values.clone()
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
    src2, len2, prev2 = random_batch(task.source_dictionary, batch=2, src_len=30, tgt_len=8)
    model_gradients(model, encoding, src2, len2, prev2)
    assert len(calls) == 2 and encoding._window["table"].values.size(0) >= 30
    assert torch.equal(encoding._window["table"].values[: window_table.size(0)], window_table)
    model.set_num_updates(3)
    theta, _ = model_gradients(model, encoding, src, src_lengths, prev)  # a new window: solves with gradient
    assert len(calls) == 3 and all(g.abs().sum() > 0 for g in theta)


def test_model_gradients_with_adjoint(translation_data):
    model, task, encoding = floater_model(translation_data, ["--floater-adjoint"])
    model.train()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8)
    theta, b0 = model_gradients(model, encoding, src, src_lengths, prev)
    assert all(g.abs().sum() > 0 for g in theta) and all(g.abs().sum() > 0 for g in b0)


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


def train_a_little(model, task, steps=3, max_len=32, seed=0, lr=0.5):
    """fairseq-style updates: in place on p.data (which does not bump the parameter version)."""
    model.train()
    for step in range(steps):
        src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=max_len - 4 * step,
                                              tgt_len=max_len - 3 * step, seed=seed + step)
        model.zero_grad()
        logits, _ = model(src, src_lengths, prev)
        F.cross_entropy(logits.view(-1, logits.size(-1)), src[:, :1].expand(-1, prev.size(1)).reshape(-1)).backward()
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.data.add_(parameter.grad, alpha=-lr)
        model.set_num_updates(step + 1)


def test_trained_on_32_tokens_runs_on_1000(translation_data):
    model, task, encoding = floater_model(translation_data, ["--max-source-positions", "64", "--max-target-positions", "64",
                                                             "--floater-init", "small"])
    train_a_little(model, task, lr=0.05)
    assert encoding.dynamics.fc2.weight.abs().max() > 0.01  # h moved
    model.eval()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=1, src_len=1000, tgt_len=1000)
    with torch.no_grad():
        logits, _ = model(src, src_lengths, prev)
    assert torch.isfinite(logits).all() and encoding.table(1000).size(0) >= 1000
    assert torch.isfinite(encoding.table(1000)).all()


def test_checkpoint_holds_no_table_and_reloads_to_identical_outputs(translation_data, tmp_path):
    model, task, encoding = floater_model(translation_data)
    perturb(model)
    train_a_little(model, task)
    model.eval()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=40, tgt_len=30, seed=7)
    with torch.no_grad():
        expected, _ = model(src, src_lengths, prev)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    # only parameters: checkpoint averaging and EMA combine entries key by key
    assert not any(key.startswith("positional_encoding.") and "dynamics" not in key for key in state)

    reloaded, _, reloaded_encoding = floater_model(translation_data)
    reloaded.load_state_dict(state, strict=True)
    reloaded.eval()
    with torch.no_grad():
        got, _ = reloaded(src, src_lengths, prev)
        # incremental decoding reads the same table
        encoder_out = reloaded.encoder(src, src_lengths=src_lengths)
        state_inc = {}
        for t in range(prev.size(1)):
            step, _ = reloaded.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state_inc)
            assert (step[:, 0] - expected[:, t]).abs().max() <= 1e-5
    assert torch.equal(got, expected)
    # a stale table is not used: change the parameters and the outputs follow them
    with torch.no_grad():
        reloaded_encoding.dynamics.fc2.bias.data.add_(0.5)
        changed, _ = reloaded(src, src_lengths, prev)
    assert (changed - expected).abs().max() > 1e-3


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
        checks = []
        monkeypatch.setattr(type(encoding), "_flat_parameters",
                            lambda self, dtype, original=type(encoding)._flat_parameters: checks.append(1) or original(self, dtype))
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


def test_training_switches(translation_data):
    model, _, encoding = floater_model(translation_data, ["--floater-train-dynamics-only"])
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in encoding.dynamics.parameters()}
    model, _, encoding = floater_model(translation_data, ["--floater-freeze-dynamics"])
    assert not any(p.requires_grad for p in encoding.dynamics.parameters())
    assert all(p.requires_grad for p in encoding.initial_parameters())
    model, _, encoding = floater_model(translation_data, ["--floater-init", "small"])
    assert 0 < encoding.dynamics.fc2.weight.abs().max() < 0.01
    model, _, encoding = floater_model(translation_data, ["--floater-hidden", "16"])
    assert encoding.dynamics.fc1.weight.shape == (16, 33) and encoding.dynamics.fc2.weight.shape == (32, 17)


def test_fairseq_train_transformer_floater(translation_data, tmp_path):
    command = ["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", "transformer_floater",
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--max-update", "4"]
    out = run(command + ["--save-dir", tmp_path / "plain", "--disable-validation"])
    assert "num_updates 4" in out
    out = run(command + ["--save-dir", tmp_path / "k3", "--floater-recompute-every", "3", "--floater-adjoint",
                         "--update-freq", "2"])
    assert "num_updates 4" in out and "valid" in out
    state = torch.load(tmp_path / "k3" / "checkpoint_last.pt", weights_only=False)["model"]
    assert float(state["positional_encoding.window_index"]) == 1  # the window of updates 3..5


def test_fairseq_train_roberta_floater(masked_lm_data, tmp_path):
    out = run(["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, "--arch", "roberta_floater",
               "--task", "masked_lm", "--tokens-per-sample", "64", "--criterion", "masked_lm",
               *TINY_ROBERTA, *QUICK_TRAIN, "--max-update", "3", "--save-dir", tmp_path,
               "--floater-recompute-every", "3", "--disable-validation"])
    assert "num_updates 3" in out


def test_projections_with_hooks_get_the_same_biases(translation_data):
    """A projection carrying forward hooks (fairseq's quant-noise wraps q/k/v_proj so) is called
    as a module, with b(t) swapped in for its bias afterwards: the same output as the direct path."""
    model, task, _ = floater_model(translation_data)
    model.eval()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=9, tgt_len=7)
    with torch.no_grad():
        direct, _ = model(src, src_lengths, prev)
        called = []
        for module in model.modules():
            if isinstance(module, PositionalAttention):
                for which in "qkv":
                    getattr(module, f"{which}_proj").register_forward_pre_hook(lambda *_: called.append(1))
        hooked, _ = model(src, src_lengths, prev)
    assert len(called) == 3 * (2 + 2 + 2)  # every q/k/v projection of the tiny model went through its hooks
    assert (hooked - direct).abs().max() <= 1e-5 * direct.abs().max()
    model.positional_encoding.reset_to_identity()  # the biases matter: without them the output moves
    with torch.no_grad():
        assert (model(src, src_lengths, prev)[0] - direct).abs().max() > 1e-3


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("extra", [[], ["--floater-recompute-every", "3"]], ids=["K=1", "K=3"])
def test_an_unpadded_batch_reads_table_rows_shared_by_the_batch(translation_data, monkeypatch, extra, padding):
    """Every row of an unpadded (or right-padded) stack holds positions 0..T-1 (`shared_range`):
    each projection's bias is a (T, 1, E) slice of the table, broadcast over the batch, with no
    gather. The real tokens' outputs and every gradient (of a loss over real tokens, as fairseq's)
    equal the gathered path's (the same positions taken as any other tensor, pads at 0)."""
    model, task, _ = floater_model(translation_data, extra)
    perturb(model)
    model.train()
    dictionary = task.source_dictionary
    src, src_lengths, prev = random_batch(dictionary, batch=3, src_len=7, tgt_len=5)
    src = torch.randint(dictionary.nspecial, len(dictionary), src.shape, generator=torch.Generator().manual_seed(2))
    src[:, -1], src_lengths = dictionary.eos(), torch.full_like(src_lengths, src.size(1))
    if padding == "right":
        src[0, 4], src[0, 5:], src_lengths[0] = dictionary.eos(), dictionary.pad(), 5
        prev[2, 3:] = dictionary.pad()
    real = prev.ne(dictionary.pad())
    gathered = []
    original = floater_module.GatherSlots.apply
    monkeypatch.setattr(floater_module.GatherSlots, "apply",
                        staticmethod(lambda *args: gathered.append(1) or original(*args)))

    def loss_and_gradients():
        torch.manual_seed(3)  # the same dropout masks in both runs
        model.zero_grad()
        logits, _ = model(src, src_lengths, prev)
        logits.float().logsumexp(-1)[real].mean().backward()
        return logits.detach()[real], {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    if extra:
        loss_and_gradients()  # the window's first pass (solved with gradient); both below reuse its table
    shared, shared_grads = loss_and_gradients()
    assert gathered == []
    monkeypatch.setattr(floater_module, "is_shared_range", lambda positions: False)
    gathered_logits, gathered_grads = loss_and_gradients()
    assert len(gathered) == 3  # one gather per group: encoder q/k/v, target tokens, source keys/values
    assert torch.allclose(shared, gathered_logits, atol=1e-6)
    assert shared_grads.keys() == gathered_grads.keys()
    dynamics = shared_grads["positional_encoding.dynamics.fc1.weight"]
    assert bool(dynamics.abs().max() > 0) == (extra == [])  # h learns on every pass with K = 1 only
    for name, grad in shared_grads.items():
        assert torch.allclose(grad, gathered_grads[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("padded", [False, True], ids=["same position", "left-padded row"])
def test_a_decoding_step_gathers_the_target_biases_once_for_all_layers(translation_data, monkeypatch, padded):
    """One decoding step: a single gather serves the decoder's q/k/v and the cross-attention queries
    of every layer (all at the step's target position), and the step equals the full forward pass.
    Without padding every row's token is at the same position: no gather at all, one bias row per
    projection. (No input embedding: fairseq's sinusoidal one numbers a left-padded row's decoding
    steps differently from its full pass.)"""
    model, task, _ = floater_model(translation_data, ["--input-positions", "none"])
    model.eval()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=7, tgt_len=5)
    if padded:
        prev[1, 0] = task.target_dictionary.pad()
    gathered = []
    original = floater_module.GatherSlots.gather
    monkeypatch.setattr(floater_module.GatherSlots, "gather",
                        staticmethod(lambda table, *args: gathered.append(table.size(1)) or original(table, *args)))  # slots
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state, steps = {}, []
        for t in range(prev.size(1)):
            gathered.clear()
            step, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            steps.append(step)
            if t > 0:  # (the first step also gathers the cross-attention keys/values at source positions)
                layers = len(model.decoder.layers)
                # q, k, v and the cross-attention query of each layer
                assert gathered == ([4 * layers] if padded else [])
    seen = slice(1, None) if padded else slice(None)  # (the padded row's first output is at a pad)
    assert torch.allclose(torch.cat(steps, dim=1)[:, seen], full[:, seen], atol=1e-5)


def test_later_decoding_steps_read_the_row_their_pass_checked(translation_data, monkeypatch):
    """An inference pass's later decoding steps take the target biases from the group table its
    first call checked (no per-projection lookup of the table), and equal the full forward pass;
    after a p.data update of h the next pass reads the re-solved table, not the previous pass's rows."""
    model, task, encoding = floater_model(translation_data, ["--input-positions", "none"])
    model.eval()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=7, tgt_len=8)
    looked_up = []
    original = type(encoding)._gathered
    monkeypatch.setattr(type(encoding), "_gathered",
                        lambda self, *args, original=original: looked_up.append(1) or original(self, *args))

    def decode():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state = {}
        steps = [model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state=state)[0]]
        for t in range(1, prev.size(1)):
            looked_up.clear()
            steps.append(model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0])
            assert looked_up == [], t  # the step's biases were handed over by begin()
        return torch.cat(steps, dim=1)

    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        assert torch.allclose(decode(), full, atol=1e-5)
        encoding.dynamics.fc2.bias.data.add_(0.5)  # as fairseq's optimizers write: no version bump
        moved, _ = model(src, src_lengths, prev)
        assert (moved - full).abs().max() > 1e-3
        assert torch.allclose(decode(), moved, atol=1e-5)


def test_autonomous_dynamics_ignore_the_time_input(translation_data):
    # the paper's h with its time columns zeroed is the reference: the biases equal a hand-written
    # RK4 loop of h(b) although the model's own time columns are far from zero
    model, encoding = check_against_reference(translation_data, "rk4", [], 0.0, ["--floater-autonomous"])
    dynamics = encoding.dynamics
    assert dynamics.fc1.weight[:, -1].abs().min() > 0 and dynamics.fc2.weight[:, -1].abs().min() > 0
    timeless = floater_module.Dynamics(dynamics.fc1.in_features - 1, dynamics.fc1.out_features).double()
    timeless.load_state_dict(dynamics.state_dict())
    with torch.no_grad():
        timeless.fc1.weight[:, -1] = 0
        timeless.fc2.weight[:, -1] = 0
    b0 = encoding.initial_values().detach()  # (the encoding's slot order, as its table)
    reference = reference_solve(make_h(timeless), b0, 12, encoding.delta, encoding.substeps, "rk4_38") - b0
    table = encoding.solve(12).detach()
    assert (table - reference).abs().max() <= 1e-12
    assert table.abs().max() > 1e-2
    # an autonomous flow is shift-invariant: from b(t_3), 5 more positions reach b(t_8)
    shifted = reference_solve(make_h(timeless), b0 + reference[3], 6, encoding.delta, encoding.substeps, "rk4_38")
    assert (shifted[-1] - b0 - reference[8]).abs().max() <= 1e-12
    # the time columns get no gradient (they stay what they are); the rest does
    encoding.solve(8).pow(2).sum().backward()
    assert dynamics.fc1.weight.grad[:, -1].abs().max() == 0 and dynamics.fc2.weight.grad[:, -1].abs().max() == 0
    assert dynamics.fc1.weight.grad[:, :-1].abs().max() > 0 and dynamics.fc2.weight.grad[:, :-1].abs().max() > 0


def test_autonomous_zero_init_is_the_identity_and_old_configs_load_without_it(translation_data):
    model, task, encoding = floater_model(translation_data, ["--floater-autonomous"])
    assert encoding.solve(20).abs().max() == 0  # zero last layer: b(t) == b(0) still
    with pytest.raises(ValueError, match="--floater-autonomous with --floater-recompute-every"):
        floater_model(translation_data, ["--floater-autonomous", "--floater-recompute-every", "3"])
    # a config written before the option existed has no floater_autonomous: the paper's h, as before
    _, _, args = build_model(translation_data, "transformer_floater", TINY_TRANSFORMER)
    vars(args).pop("floater_autonomous", None)
    assert not floater_module.Floater(args, encoding.dims).dynamics.autonomous


def bounded_model(translation_data, max_speed, decay, extra=()):
    options = ["--floater-max-speed", str(max_speed), *(["--floater-decay", str(decay)] if decay else []), *extra]
    model, _, encoding = floater_model(translation_data, options)
    model.double().eval()
    perturb(model, scale=3.0)  # a fast, exponentially growing flow without the bounds
    return model, encoding


@pytest.mark.parametrize("decay", [0.0, 1.5])
def test_bounded_flow_equals_a_hand_written_loop_of_the_bounded_h(translation_data, decay):
    model, encoding = bounded_model(translation_data, 0.7, decay)
    paper_h = make_h(encoding.dynamics)

    def h(t, b):  # db/dt = exp(-L t) S tanh(h / S)
        return math.exp(-decay * t) * 0.7 * torch.tanh(paper_h(t, b) / 0.7)

    b0 = encoding.initial_values().detach()
    reference = reference_solve(h, b0, 30, encoding.delta, encoding.substeps, "rk4_38") - b0
    table = encoding.solve(30).detach()
    assert (table - reference).abs().max() <= 1e-12
    unbounded = reference_solve(paper_h, b0, 30, encoding.delta, encoding.substeps, "rk4_38") - b0
    assert unbounded.abs().max() > 10 * table.abs().max()  # the bounds are what holds it


def test_bounded_flow_keeps_every_coordinate_within_its_bound(translation_data):
    speed, decay = 0.5, 2.0
    model, encoding = bounded_model(translation_data, speed, decay)
    table = encoding.solve(300).detach()  # t up to 29.9: far beyond the bound's time scale 1/L
    times = torch.arange(300, dtype=torch.float64) * encoding.delta
    bound = speed / decay * (1 - torch.exp(-decay * times))  # |b(t) - b(0)| <= integral of S exp(-L tau)
    assert (table.abs().amax(dim=(1, 2)) <= bound * (1 + 1e-6)).all()
    assert table.abs().max() > 0.5 * speed / decay  # near the bound, not trivially below it
    # settled: past position 20 (t = 2) the biases move less than the bound leaves, S/L exp(-L t_20)
    assert (table[20:] - table[20]).abs().max() <= speed / decay * math.exp(-decay * times[20].item()) * (1 + 1e-6)
    # the same bound with the speed alone: S t
    model, encoding = bounded_model(translation_data, speed, 0.0)
    table = encoding.solve(300).detach()
    assert (table.abs().amax(dim=(1, 2)) <= speed * times * (1 + 1e-6)).all()


def test_bounded_options_keep_the_identity_and_old_configs_load_without_them(translation_data):
    model, _, encoding = floater_model(translation_data, ["--floater-max-speed", "2", "--floater-decay", "1"])
    assert encoding.solve(40).abs().max() == 0  # zero last layer: b(t) == b(0)
    assert not encoding.dynamics.is_paper_form
    _, _, args = build_model(translation_data, "transformer_floater", TINY_TRANSFORMER)
    for name in ("floater_max_speed", "floater_decay"):  # a config written before the options existed
        vars(args).pop(name, None)
    dynamics = floater_module.Floater(args, encoding.dims).dynamics
    assert dynamics.is_paper_form and dynamics.max_speed is None and dynamics.decay == 0
    for bad in (["--floater-max-speed", "0"], ["--floater-decay", "-1"]):
        with pytest.raises(SystemExit):  # argparse rejects them (and names the option on stderr)
            floater_model(translation_data, bad)


def test_fairseq_train_with_the_bounded_autonomous_flow(translation_data, tmp_path):
    options = ["--floater-autonomous", "--floater-max-speed", "2", "--floater-decay", "1"]
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", "transformer_floater",
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--max-update", "3", "--save-dir", tmp_path, "--disable-validation",
               *options])
    assert "num_updates 3" in out
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
    dynamics = state["model"]
    assert dynamics["positional_encoding.dynamics.fc2.weight"][:, :-1].abs().max() > 0  # h was trained
    assert dynamics["positional_encoding.dynamics.fc2.weight"][:, -1].abs().max() == 0  # its time column not
    config = state["cfg"]["model"]
    assert (config.floater_autonomous, config.floater_max_speed, config.floater_decay) == (True, 2.0, 1.0)
    # the stop is set when loading (the longest training input is known then), as fairseq-generate's
    # --model-overrides does; without it the checkpoint loads as trained
    from fairseq import checkpoint_utils
    for overrides, stop in (None, None), ({"floater_stop_position": 4}, 4):
        models, _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "checkpoint_last.pt")],
                                                         arg_overrides=overrides)
        encoding = models[0].positional_encoding
        assert encoding.stop_position == stop and encoding.dynamics.max_speed == 2.0
        table = encoding.solve(30).detach()
        assert table.abs().max() <= 2.0 / 1.0 and table[-1].abs().max() > 0
        assert torch.equal(table[4:], table[4:5].expand_as(table[4:])) == (stop is not None)


def test_the_flow_stops_at_the_stop_position(translation_data):
    model, _, encoding = floater_model(translation_data, ["--floater-stop-position", "9"])
    model.double().eval()
    perturb(model)
    b0 = encoding.initial_values().detach()
    reference = reference_solve(make_h(encoding.dynamics), b0, 9, encoding.delta, encoding.substeps, "rk4_38") - b0
    table = encoding.solve(40).detach()
    assert (table[:9] - reference).abs().max() <= 1e-12  # positions 0..N-1: the paper's flow
    assert torch.equal(table[9:], table[9:10].expand_as(table[9:]))  # N on: one bias
    assert (table[9] - table[8]).abs().max() > 1e-3  # (half an interval more than N-1)
