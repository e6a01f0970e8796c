"""What the FLOATER tests share: a tiny FLOATER model, a perturbation that makes h and the biases move,
the slots walked independently of the encoding, and hand-written fixed-step loops of the ODE."""
import torch

from posenc_fairseq.attention import PositionalAttention
from posenc_fairseq.encodings.floater import solver
from util import TINY_ROBERTA, TINY_TRANSFORMER, build_model, random_batch


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


def model_gradients(model, encoding, src, src_lengths, prev):
    model.zero_grad()
    logits, _ = model(src, src_lengths, prev)
    (logits.float().log_softmax(-1)[..., 5].sum()).backward()
    return ([p.grad for p in encoding.dynamics.parameters()], [p.grad for p in encoding.initial_parameters()])


def counting_solves(monkeypatch):
    """Count the fixed-grid solves (each call of the fast integrator)."""
    calls = []
    original = solver.fixed_grid_solve

    def counting(*args):
        calls.append(args[2] - args[1] + 1)  # positions solved
        return original(*args)

    monkeypatch.setattr(solver, "fixed_grid_solve", counting)
    return calls

