"""The FLOATER encoding against hand-written references: a fixed-step RK4 / Euler loop of the same ODE,
the stock model (h == 0), its slots, gradients and checkpoints, the biases' gather (`GatherSlots`,
rows shared by an unpadded batch, one gather per decoding step), and fairseq's own training. The
solver is tested in test_floater_solver.py, the kept tables in test_floater_table.py, h's forms in
test_floater_dynamics.py, checkpoint workflows in test_floater_workflows.py."""
import pytest
import torch
import torch.nn.functional as F

from floater_util import check_against_reference, expected_slots, floater_model, model_gradients, perturb
from posenc_fairseq.attention import PositionalAttention
from posenc_fairseq.encodings.floater import GatherSlots
from posenc_fairseq.encodings.floater import encoding as encoding_module
from util import QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, build_model, random_batch, run


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


def test_model_gradients_with_adjoint(translation_data):
    model, task, encoding = floater_model(translation_data, ["--floater-adjoint"])
    model.train()
    perturb(model)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8)
    theta, b0 = model_gradients(model, encoding, src, src_lengths, prev)
    assert all(g.abs().sum() > 0 for g in theta) and all(g.abs().sum() > 0 for g in b0)


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
    train_a_little(model, task, lr=0.05)  # (0.5 sends some initialisations to NaN: the overflow check refuses them)
    model.eval()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=40, tgt_len=30, seed=7)
    with torch.no_grad():
        expected, _ = model(src, src_lengths, prev)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    # only parameters and the entry of what they were trained with (a fixed-size tensor): checkpoint
    # averaging and EMA combine entries key by key
    assert [key for key in state if key.startswith("positional_encoding.") and "dynamics" not in key] == \
        ["positional_encoding.trained_with"]

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
    as a module where stock calls it (cross-attention, decoding steps; stock's fused self-attention
    path reads the weights only), with b(t) swapped in for its bias afterwards: the same output as
    the direct path."""
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
    assert len(called) == 3 * 2  # the q/k/v projections of the tiny model's 2 cross-attention layers
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
    original = GatherSlots.apply
    monkeypatch.setattr(GatherSlots, "apply",
                        staticmethod(lambda *args: gathered.append(1) or original(*args)))

    def loss_and_gradients():
        torch.manual_seed(3)  # the same dropout masks in both runs
        model.zero_grad()
        logits, _ = model(src, src_lengths, prev)
        logits.float().logsumexp(-1)[real].mean().backward()
        return logits.detach()[real], {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    if extra:
        model.set_num_updates(0)
        loss_and_gradients()  # the window's first update (solved with gradient)
        model.set_num_updates(1)  # a later update of the window: both passes below reuse its table
    shared, shared_grads = loss_and_gradients()
    assert gathered == []
    monkeypatch.setattr(encoding_module, "is_shared_range", lambda positions: False)
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
    original = GatherSlots.gather
    monkeypatch.setattr(GatherSlots, "gather",
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


def test_gathered_slot_biases_and_their_gradients():
    """GatherSlots: each slot's rows at the positions (checked against plain indexing), and
    gradients by finite differences, also when some slots get no gradient (cross-attention's
    keys and values of a call that only uses its queries)."""
    torch.manual_seed(0)
    table = torch.randn(7, 3, 5, dtype=torch.float64, requires_grad=True)  # (rows, slots, d)
    positions = torch.tensor([[0, 1, 2, 6], [3, 3, 0, 1]])  # (batch, length), repeated rows
    index = positions.t().reshape(-1)
    biases = GatherSlots.apply(table, index, 2, 4)
    for slot, bias in enumerate(biases):
        assert torch.equal(bias, table[:, slot][positions].transpose(0, 1))  # (length, batch, d)

    def used(t):
        out = GatherSlots.apply(t, index, 2, 4)
        return out[0].sin(), (out[2] ** 2)  # slot 1 unused
    torch.autograd.gradcheck(used, (table,))
    (used(table)[1].sum()).backward()
    assert table.grad[:, 1].abs().max() == 0 and table.grad[:, 0].abs().max() == 0 and table.grad[:, 2].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gathered_biases_sum_their_gradients_in_float32(dtype, device):
    """A position that many rows of a left-padded batch share: its table row's gradient is the sum
    of theirs in float32, rounded once (a half-precision running sum of ones stops at 256 (bf16) or
    2048 (fp16); CUDA's index_add_ adds atomically in the tensor's dtype)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class IndexAdds(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("index_add"):
                dtypes.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    batch, dtypes = 5000, []
    table = torch.zeros(3, 2, 4, dtype=dtype, device=device, requires_grad=True)
    index = torch.ones(batch, dtype=torch.long, device=device)  # one position, every row of the batch
    biases = GatherSlots.apply(table, index, batch, 1)
    with IndexAdds():
        (grad,) = torch.autograd.grad(biases, table, [torch.ones_like(bias) for bias in biases])
    assert dtypes == [torch.float32]  # (on CPU torch's index_add_ happens to sum rows exactly itself)
    assert grad.dtype == dtype and grad[1].eq(batch).all() and not grad[[0, 2]].any()


def test_loading_parameters_drops_the_window_solved_from_the_old_ones(translation_data):
    """K = 3: a window opened before load_state_dict was solved from the parameters the load replaces; a
    later update of its count must not read it (the loaded state's count is not a resume: nothing adopted).
    The pass solves from the loaded parameters: the same logits as a model built with them."""
    quiet = ["--floater-recompute-every", "3", "--dropout", "0", "--attention-dropout", "0",
             "--activation-dropout", "0"]
    model, task, encoding = floater_model(translation_data, quiet)
    other, _, _ = floater_model(translation_data, quiet)
    perturb(model)
    perturb(other, seed=2)
    model.train(), other.train()
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=10, tgt_len=8)
    model.set_num_updates(0)
    before, _ = model(src, src_lengths, prev)  # opens window 0, solved from model's own parameters
    assert encoding.tables.window is not None
    model.load_state_dict(other.state_dict())
    model.set_num_updates(1)
    other.set_num_updates(1)
    got, _ = model(src, src_lengths, prev)
    expected, _ = other(src, src_lengths, prev)
    assert (before - expected).abs().max() > 1e-3  # (the two parameter sets give other logits)
    assert torch.equal(got, expected)
