"""FLOATER through fairseq's checkpoint workflows: averaging, EMA, exact resume inside a K-update
window, loading with other options, the dynamics learning-rate scale (composite optimizer), and
the converter's --floater-init."""
import shutil
import sys

import pytest
import torch

from fairseq import checkpoint_utils
from posenc_fairseq.convert import convert_checkpoint, load_from_state
from util import QUICK_TRAIN, REPO, TINY_TRANSFORMER, USER_DIR, build_model, random_batch, run

TRAIN = ["fairseq-train", None, "--user-dir", USER_DIR, "--arch", "transformer_floater", *TINY_TRANSFORMER,
         *QUICK_TRAIN, "--floater-init", "small", "--disable-validation", "--max-tokens", "600"]


def train(data, save_dir, *extra):
    command = list(TRAIN)
    command[1] = data
    return run(command + ["--save-dir", save_dir, *extra])


def outputs(model, task, seed=3):
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=30, tgt_len=20, seed=seed)
    model.eval()
    with torch.no_grad():
        return model(src, src_lengths, prev)[0]


def load(path, overrides=None):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides=overrides or {})
    return models[0], task


def fairseq_average(paths):
    """fairseq's scripts/average_checkpoints.py (not in the pip package): every entry of the model
    state averaged key by key, integer entries floor-divided."""
    summed = {}
    for path in paths:
        for key, value in torch.load(path, map_location="cpu", weights_only=False)["model"].items():
            value = value.clone().float() if value.is_floating_point() else value.clone()
            summed[key] = value if key not in summed else summed[key] + value
    return {key: value / len(paths) if value.is_floating_point() else value // len(paths) for key, value in summed.items()}


def test_checkpoint_averaging_averages_parameters_and_re_solves(translation_data, tmp_path):
    train(translation_data, tmp_path, "--max-update", "5", "--save-interval-updates", "2",
          "--floater-recompute-every", "2")
    paths = sorted(tmp_path.glob("checkpoint_*_*.pt"))
    assert len(paths) == 2
    average = tmp_path / "average.pt"
    run([sys.executable, REPO / "examples/translation/average_checkpoints.py", "--inputs", tmp_path,
         "--num-update-checkpoints", "2", "--output", average])
    model, task = load(average)
    # reference: a model holding the parameters averaged here, its table solved from them
    reference, _ = load(paths[-1])
    expected_state = fairseq_average(paths)
    parameters = dict(reference.named_parameters())
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(expected_state[name])
    expected = outputs(reference, task)
    assert torch.allclose(outputs(model, task), expected, atol=1e-5)
    for path in paths:  # the average is really something else than either checkpoint
        assert (outputs(load(path)[0], task) - expected).abs().max() > 1e-4
    # fairseq's own averaging logic gives a state that loads (fixed shapes) and evaluates the same
    model.load_state_dict(expected_state, strict=True)
    assert torch.allclose(outputs(model, task), expected, atol=1e-5)


def test_store_ema_trains_and_the_ema_model_evaluates(translation_data, tmp_path):
    train(translation_data, tmp_path, "--max-update", "4", "--store-ema", "--ema-decay", "0.5",
          "--floater-recompute-every", "3")
    checkpoint = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    ema_state = checkpoint["extra_state"]["ema"]
    model, task = load(tmp_path / "checkpoint_last.pt")
    final = outputs(model, task)
    model.load_state_dict(ema_state, strict=True)
    ema = outputs(model, task)
    assert torch.isfinite(ema).all() and (ema - final).abs().max() > 1e-5
    fc2 = "positional_encoding.dynamics.fc2.weight"
    assert not torch.equal(ema_state[fc2], checkpoint["model"][fc2])  # h is averaged too
    # the EMA model computes what a model holding the EMA parameters computes
    fresh, _ = load(tmp_path / "checkpoint_last.pt")
    with torch.no_grad():
        for name, parameter in fresh.named_parameters():
            parameter.copy_(ema_state[name])
    assert torch.equal(outputs(fresh, task), ema)


def final_parameters(path):
    return {k: v for k, v in torch.load(path, map_location="cpu", weights_only=False)["model"].items()}


@pytest.mark.slow
def test_resume_inside_a_k_update_window_is_exact(translation_data, tmp_path):
    options = ["--floater-recompute-every", "4", "--max-update", "6", "--dropout", "0.1"]
    straight = tmp_path / "straight"
    train(translation_data, straight, *options, "--save-interval-updates", "3")
    middle = next(straight.glob("checkpoint_*_3.pt"))  # saved after update 3: inside the window 0..3
    assert float(final_parameters(middle)["positional_encoding.window_index"]) == 0

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(middle, resumed / "checkpoint_last.pt")
    train(translation_data, resumed, *options)
    expected, got = final_parameters(straight / "checkpoint_last.pt"), final_parameters(resumed / "checkpoint_last.pt")
    assert all(torch.equal(got[key], expected[key]) for key in expected), "resume is not exact"

    # without the window's snapshot the resumed run differs (what the snapshot is for)
    lost = tmp_path / "lost"
    lost.mkdir()
    state = torch.load(middle, map_location="cpu", weights_only=False)
    state["model"] = {k: v for k, v in state["model"].items() if "window_" not in k}
    torch.save(state, lost / "checkpoint_last.pt")
    train(translation_data, lost, *options)
    differs = final_parameters(lost / "checkpoint_last.pt")
    assert any(not torch.equal(differs[key], expected[key]) for key in expected if "window_" not in key)


@pytest.mark.slow
@pytest.mark.parametrize("restart", [["--finetune-from-model"], ["--reset-optimizer", "--restore-file"]])
def test_training_that_counts_again_from_zero_starts_its_own_window(translation_data, tmp_path, restart):
    """A checkpoint saved inside window 0 (update 3 of K = 4), fine-tuned or trained on with
    --reset-optimizer: the update count starts again at 0, and so does the window, from the loaded
    parameters. The saved window (solved from the first run's parameters at update 0) would serve
    stale biases and give h no gradient for K updates: the result must equal a run from the same
    checkpoint without its window."""
    options = ["--floater-recompute-every", "4", "--dropout", "0"]
    first = tmp_path / "first"
    train(translation_data, first, *options, "--max-update", "3")
    saved = first / "checkpoint_last.pt"
    assert float(final_parameters(saved)["positional_encoding.window_index"]) == 0
    state = torch.load(saved, map_location="cpu", weights_only=False)
    state["model"] = {k: v for k, v in state["model"].items() if "window_" not in k}
    without_window = tmp_path / "without_window.pt"
    torch.save(state, without_window)
    finals = []
    for name, source in (("with", saved), ("without", without_window)):
        train(translation_data, tmp_path / name, *options, "--max-update", "2", *restart, source)
        finals.append(final_parameters(tmp_path / name / "checkpoint_last.pt"))
    with_window, expected = finals
    h = [key for key in expected if ".dynamics." in key]
    assert h and any(not torch.equal(expected[key], final_parameters(saved)[key]) for key in h)  # h trained
    assert all(torch.equal(with_window[key], expected[key]) for key in expected if "window_" not in key)


def test_loading_with_other_options_solves_for_those_options(translation_data, tiny_checkpoint):
    path = tiny_checkpoint("transformer_floater", "--floater-init", "small")  # (shared with scripts/test_plot_positions.py)
    model, task = load(path)
    for overrides in ({"floater_delta": 0.2}, {"floater_first_block_only": True}, {"floater_method": "midpoint"}):
        overridden, _ = load(path, overrides)
        # reference: the same parameters in a model built with those options
        reference, _, _ = build_model(translation_data, "transformer_floater",
                                      [*TINY_TRANSFORMER, *[f"--{k.replace('_', '-')}" for k in overrides
                                                            if overrides[k] is True],
                                       *[part for k, v in overrides.items() if v is not True
                                         for part in (f"--{k.replace('_', '-')}", str(v))]])
        reference.load_state_dict(dict(model.state_dict()), strict=True)
        assert torch.equal(outputs(overridden, task), outputs(reference, task)), overrides
        assert not torch.equal(outputs(overridden, task), outputs(model, task)), overrides  # h is small: barely


def hydra_train(data, save_dir, *overrides):
    command = [str(REPO / ".venv/bin/fairseq-hydra-train") if (REPO / ".venv/bin/fairseq-hydra-train").exists()
               else "fairseq-hydra-train",
               "--config-dir", REPO / "examples/translation/config", "--config-name", "floater_dynamics_lr",
               f"task.data={data}", f"common.user_dir={USER_DIR}", "common.cpu=true", "common.seed=1",
               f"checkpoint.save_dir={save_dir}", f"hydra.run.dir={save_dir}/hydra", "dataset.max_tokens=2000",
               "dataset.disable_validation=true", "dataset.num_workers=0", "common.log_interval=1",
               *[f"+model.{name}={value}" for name, value in (
                   ("encoder_layers", 2), ("decoder_layers", 2), ("encoder_embed_dim", 32), ("decoder_embed_dim", 32),
                   ("encoder_ffn_embed_dim", 64), ("decoder_ffn_embed_dim", 64), ("encoder_attention_heads", 4),
                   ("decoder_attention_heads", 4), ("floater_init", "small"))],
               *overrides]
    return run(command)


def test_dynamics_learning_rate_scale_through_the_composite_optimizer(translation_data, tmp_path):
    # one update with the recipe's settings, then one more from it with a fresh Adam and a constant
    # learning rate: Adam's first step moves every parameter by its learning rate (g / |g|), so h's
    # largest change is X times the others'
    hydra_train(translation_data, tmp_path / "first", "optimization.max_update=1")
    log = hydra_train(translation_data, tmp_path / "second", "optimization.max_update=1",  # --reset-optimizer: counts from 0
                      f"checkpoint.restore_file={tmp_path / 'first' / 'checkpoint_last.pt'}",
                      "checkpoint.reset_optimizer=true", "checkpoint.reset_lr_scheduler=true",
                      "checkpoint.reset_dataloader=true", "checkpoint.reset_meters=true",
                      "model.floater_dynamics_lr_scale=10", "model.dropout=0",
                      "optimizer.groups.default.lr_float=0.001", "optimizer.groups.default.optimizer.weight_decay=0",
                      "optimizer.groups.default.lr_scheduler._name=fixed",
                      "~optimizer.groups.default.lr_scheduler.warmup_updates")
    assert "'lr': [0.01]" in log and "'lr': [0.001]" in log
    before = final_parameters(tmp_path / "first" / "checkpoint_last.pt")
    after = final_parameters(tmp_path / "second" / "checkpoint_last.pt")
    change = {key: (after[key] - before[key]).abs().max().item() for key in before if "window_" not in key}
    dynamics = max(v for k, v in change.items() if ".dynamics." in k)
    others = max(v for k, v in change.items() if ".dynamics." not in k)
    assert dynamics == pytest.approx(0.01, rel=1e-3) and others == pytest.approx(0.001, rel=1e-3)


def test_dynamics_learning_rate_scale_needs_the_composite_optimizer(translation_data):
    with pytest.raises(ValueError, match="composite"):
        build_model(translation_data, "transformer_floater",
                    [*TINY_TRANSFORMER, "--floater-dynamics-lr-scale", "10", "--optimizer", "adam"])


def test_dynamics_learning_rate_scale_under_hydra_needs_the_composite_optimizer():
    """Under fairseq-hydra-train the model's config is a node of the run's, without an `optimizer` of its
    own: before, the check found none, and with `optimizer: adam` the scale was ignored without a word
    (h moved by the others' learning rate). The run's `optimizer._name` is read now."""
    from omegaconf import OmegaConf

    from posenc_fairseq.encodings import ModelDims, build_encoding
    from posenc_fairseq.encodings.option_types import OptionValueError

    run = OmegaConf.create({"optimizer": {"_name": "adam"}, "model": {"floater_dynamics_lr_scale": 10.0}})
    with pytest.raises(OptionValueError, match="needs fairseq's composite optimizer \\(got --optimizer adam\\)"):
        build_encoding("floater", run.model, ModelDims(16, 2, 1, 1))
    run.optimizer._name = "composite"
    assert build_encoding("floater", run.model, ModelDims(16, 2, 1, 1)).dynamics_lr_scale == 10.0


def test_converter_honours_floater_init_small(stock_transformer_checkpoint):
    state = torch.load(stock_transformer_checkpoint, map_location="cpu", weights_only=False)
    zero = convert_checkpoint(state, "transformer", "floater")
    small = convert_checkpoint(state, "transformer", "floater", {"floater_init": "small"})
    fc2 = "positional_encoding.dynamics.fc2.weight"
    assert zero["model"][fc2].abs().max() == 0
    assert 0 < small["model"][fc2].abs().max() < 0.01
    # the config records the option, and the model fairseq builds from it holds the small h
    model, _, _ = load_from_state(small, "transformer")
    assert model.positional_encoding.init == "small"
    assert torch.equal(model.state_dict()[fc2], small["model"][fc2])


def test_fairseq_train_stops_on_an_overflowing_table_with_the_message(translation_data, tmp_path):
    """Through fairseq's trainer: a checkpoint whose h overflows fp32 within the toy sentences' lengths
    (db/dt = 300 b), resumed by fairseq-train, stops with FLOATER's overflow message, not fairseq's bare
    "gradients are Nan/Inf": the training pass does not wait for its table's check, the trainer finds
    its gradients not finite and runs the batch again, and that pass reads the check and names it."""
    train(translation_data, tmp_path, "--max-update", "1")
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    fc1 = [key for key in state["model"] if key.endswith("dynamics.fc1.weight")]
    assert len(fc1) == 1
    prefix = fc1[0][: -len("fc1.weight")]
    weights, dim = state["model"], state["model"][prefix + "fc2.weight"].size(0)
    weights[prefix + "fc1.weight"].zero_()[:dim, :dim] = torch.eye(dim)
    weights[prefix + "fc1.bias"].fill_(10.0)
    weights[prefix + "fc2.weight"].zero_()[:, :dim] = 300 * torch.eye(dim)
    torch.save(state, tmp_path / "exploding.pt")
    with pytest.raises(AssertionError, match=r"FLOATER position biases overflow at position \d+ \(.*\) in an "
                                             r"earlier training pass"):
        train(translation_data, tmp_path / "resumed", "--restore-file", tmp_path / "exploding.pt",
              "--reset-optimizer", "--reset-dataloader", "--max-update", "3")
