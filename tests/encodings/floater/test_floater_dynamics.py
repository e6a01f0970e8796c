"""FLOATER's forms of h (dynamics.py): the autonomous flow, the bounded flow (max speed, decay) and the
stop position, against hand-written loops of the same h; identity at zero init; configs written
before the options existed."""
import math

import pytest
import torch

from floater_util import check_against_reference, floater_model, make_h, perturb, reference_solve
from posenc_fairseq.encodings.floater import Dynamics, Floater
from util import QUICK_TRAIN, TINY_TRANSFORMER, USER_DIR, build_model, run


def test_autonomous_dynamics_ignore_the_time_input(translation_data):
    # the paper's h with its time columns zeroed is the reference: the biases equal a hand-written
    # RK4 loop of h(b) although the model's own time columns are far from zero
    model, encoding = check_against_reference(translation_data, "rk4", [], 0.0, ["--floater-autonomous"])
    dynamics = encoding.dynamics
    assert dynamics.fc1.weight[:, -1].abs().min() > 0 and dynamics.fc2.weight[:, -1].abs().min() > 0
    timeless = Dynamics(dynamics.fc1.in_features - 1, dynamics.fc1.out_features).double()
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
    assert not Floater(args, encoding.dims).dynamics.autonomous


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
    dynamics = Floater(args, encoding.dims).dynamics
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


def test_the_flow_stops_halfway_between_positions_n_minus_1_and_n(translation_data):
    """Positions 0..N+2 against a hand-written loop of h gated as h(t, b) * (t <= (N - 1/2) delta):
    position N holds b((N - 1/2) delta), not b(t_N - delta) (a stop at N-1) nor b(t_N). Two steps per
    position on a dyadic grid (delta 1/8): a step ends exactly at the stop time, where h still counts."""
    model, _, encoding = floater_model(translation_data, ["--floater-stop-position", "9", "--floater-delta", "0.125",
                                                          "--floater-step-size", "0.0625"])
    model.double().eval()
    perturb(model)
    assert encoding.substeps == 2
    h, stop = make_h(encoding.dynamics), (9 - 0.5) * 0.125

    def stopped(t, b):
        return h(t, b) * (t <= stop)

    b0 = encoding.initial_values().detach()
    reference = reference_solve(stopped, b0, 12, encoding.delta, encoding.substeps, "rk4_38") - b0
    table = encoding.solve(12).detach()
    assert (table - reference).abs().max() <= 1e-12
    assert (table[9] - table[8]).abs().max() > 1e-3  # the half interval beyond N-1 is there
