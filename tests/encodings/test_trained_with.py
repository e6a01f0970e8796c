"""The entry that says what an encoding's weights were trained with (encodings/trained_with.py):
fairseq-train builds --restore-file's model from its command line, so an encoding option left out
there, or another parameter-free encoding, is refused in one line instead of silently giving the
weights another encoding. Given values are taken as meant; checkpoints without the entry load."""
import subprocess
import tempfile

import pytest
import torch

from posenc_fairseq.encodings import ENCODINGS, ModelDims, build_encoding, trained_with
from posenc_fairseq.encodings.option_types import OptionValueError
from util import (BIN, QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, build_model, command_env,
                  encoding_options, random_batch)

KEY = f"positional_encoding.{trained_with.KEY}"

#: (arch, the option as trained, its flag's dest, the value trained, the default a model left without it has)
TRAINED = [
    ("transformer_t5", ["--t5-max-distance", "64"], "t5_max_distance", 64, 128),
    ("transformer_at5", ["--at5-length-scale", "64"], "at5_length_scale", 64.0, 256.0),
    ("transformer_at5_nob", ["--at5-activation", "tanh"], "at5_activation", "tanh", "sigmoid"),
    ("transformer_lfhc", ["--lfhc-rounding", "trunc"], "lfhc_rounding", "trunc", "floor"),
    ("transformer_gcdf", ["--gcdf-lambda", "2"], "gcdf_lambda", 2.0, 4.0),
    ("transformer_rotary", ["--rotary-base", "500"], "rotary_base", 500.0, 10000.0),
    ("transformer_floater", ["--floater-stop-position", "5"], "floater_stop_position", 5, None),
    ("transformer_floater", ["--floater-autonomous"], "floater_autonomous", True, False),
]


def model(translation_data, arch, *options):
    return build_model(translation_data, arch, [*TINY_TRANSFORMER, *options])[0]


def outputs(network, task, seed=0):
    network.eval()
    source, lengths, previous = random_batch(task.source_dictionary, seed=seed)
    with torch.no_grad():
        return network(source, lengths, previous)[0]


def test_every_encoding_saves_its_name_and_the_options_that_define_it():
    dims = ModelDims(embed_dim=16, heads=4, encoder_layers=2, decoder_layers=2)
    scalar_bias, at5 = {"scalar_bias_layers"}, {"at5_activation", "at5_length_scale", "at5_mlp_widths"}
    kept = {"sinusoidal": set(), "learned": set(), "nope": set(), "alibi": set(), "xl": set(),
            "rotary": {"rotary_base"}, "gcdf": {"gcdf_lambda"}, "shaw": {"shaw_k"}, "lfhc": {"lfhc_k", "lfhc_rounding"},
            "t5": scalar_bias | {"t5_max_distance", "t5_num_buckets"}, "t5_nob": scalar_bias | {"t5_max_distance"},
            "at5": scalar_bias | at5, "at5_nob": scalar_bias | at5 | {"at5_nob_input"},
            "floater": {f"floater_{name}" for name in ("autonomous", "decay", "delta", "first_block_only", "hidden",
                                                       "max_speed", "method", "step_size", "stop_position")}}
    assert kept.keys() == ENCODINGS.keys()
    for name in ENCODINGS:
        saved = build_encoding(name, encoding_options(), dims).state_dict()[trained_with.KEY]
        assert trained_with.read(saved)["encoding"] == name
        assert trained_with.read(saved)["options"].keys() == kept[name], name
    t5 = build_encoding("t5", encoding_options("--t5-max-distance", "64", "--t5-num-buckets", "16"), dims)
    assert trained_with.read(t5.state_dict()[trained_with.KEY])["options"] == {
        "scalar_bias_layers": "first", "t5_max_distance": 64, "t5_num_buckets": 16}
    # options of training alone are not kept: changing them on a resumed run is ordinary
    floater = build_encoding("floater", encoding_options("--floater-recompute-every", "3", "--floater-init", "small",
                                                         "--floater-adjoint"), dims)
    kept = trained_with.read(floater.state_dict()[trained_with.KEY])["options"]
    assert kept["floater_method"] == "rk4" and kept["floater_step_size"] == pytest.approx(0.02)
    assert not {"floater_recompute_every", "floater_init", "floater_adjoint", "floater_tolerance"} & kept.keys()
    at5 = build_encoding("at5", encoding_options("--at5-dropout", "0.1", "--at5-gamma-init", "uniform"), dims)
    assert not {"at5_dropout", "at5_gamma_init", "at5_gamma_range", "at5_nob_input"} & \
        trained_with.read(at5.state_dict()[trained_with.KEY])["options"].keys()


@pytest.mark.parametrize("arch, trained, dest, value, default", TRAINED, ids=lambda item: str(item))
def test_a_strict_load_refuses_weights_trained_with_another_value_than_the_default(
        translation_data, arch, trained, dest, value, default):
    weights = model(translation_data, arch, *trained).state_dict()
    flag = "--" + dest.replace("_", "-")
    with pytest.raises(OptionValueError) as refused:
        model(translation_data, arch).load_state_dict(weights, strict=True)
    message = str(refused.value)
    assert message.startswith(f"{trained_with.shown(dest, default)} (the default): the checkpoint's weights were "
                              f"trained with {' '.join(trained)}; give {' '.join(trained)} to keep it"), message
    assert f"--model-overrides \"{{'{dest}': {value!r}}}\"" in message and "\n" not in message
    # the same value given, or another one given, is taken as meant; a non-strict load does not check
    model(translation_data, arch, *trained).load_state_dict(weights, strict=True)
    if not isinstance(value, bool):
        model(translation_data, arch, flag, str(default) if default is not None else "7").load_state_dict(weights)
    model(translation_data, arch).load_state_dict(weights, strict=False)
    # weights without the entry (stock fairseq's, older checkpoints) load as before
    model(translation_data, arch).load_state_dict({k: v for k, v in weights.items() if k != KEY}, strict=True)


def test_what_the_refusal_prevents_is_another_model(translation_data):
    """Rotary weights under the default base compute something else than the trained model."""
    _, task, _ = build_model(translation_data, "transformer_rotary", TINY_TRANSFORMER)
    trained = model(translation_data, "transformer_rotary", "--rotary-base", "500")
    silent = model(translation_data, "transformer_rotary")
    silent.load_state_dict({k: v for k, v in trained.state_dict().items() if k != KEY})
    assert (outputs(silent, task) - outputs(trained, task)).abs().max() > 1e-3


def test_another_parameter_free_encoding_is_refused(translation_data):
    alibi = model(translation_data, "transformer_alibi").state_dict()
    with pytest.raises(OptionValueError, match=r"^the checkpoint's weights were trained with the alibi encoding, not "
                                               r"rotary: give the checkpoint's --arch \(an architecture of the "
                                               r"alibi encoding, or --positional-encoding alibi\), or "
                                               r"--allow-encoding-change to load the weights as they are$"):
        model(translation_data, "transformer_rotary").load_state_dict(alibi, strict=True)
    model(translation_data, "transformer_alibi").load_state_dict(alibi, strict=True)


def load_with_config(translation_data, weights, arch, *options):
    """A model of `arch` built with `options` loads `weights` as fairseq's trainer does (with its config)."""
    built, _, args = build_model(translation_data, arch, [*TINY_TRANSFORMER, *options])
    built.load_state_dict(weights, strict=True, model_cfg=args)


def test_allow_encoding_change_loads_the_weights_as_they_are(translation_data):
    """The way to change on purpose what no value can be given for: a flag or an option unset by default
    (FLOATER from first-block-only weights to every block), or the encoding itself."""
    first_block = model(translation_data, "transformer_floater", "--floater-first-block-only",
                        "--floater-stop-position", "20").state_dict()
    with pytest.raises(OptionValueError, match=r"^no --floater-first-block-only, no --floater-stop-position \(the "
                                               r"defaults\): .* trained with --floater-first-block-only "
                                               r"--floater-stop-position 20; give --floater-first-block-only "
                                               r"--floater-stop-position 20 to keep them, another value to change "
                                               r"them, or --allow-encoding-change"):
        load_with_config(translation_data, first_block, "transformer_floater")
    load_with_config(translation_data, first_block, "transformer_floater", "--allow-encoding-change")
    # for that run's loads only: the config fairseq saves with the model does not keep it
    allowing, _, args = build_model(translation_data, "transformer_floater",
                                    [*TINY_TRANSFORMER, "--allow-encoding-change"])
    assert allowing.allow_encoding_change and args.allow_encoding_change is None
    alibi = model(translation_data, "transformer_alibi").state_dict()
    load_with_config(translation_data, alibi, "transformer_rotary", "--allow-encoding-change")


def test_every_differing_option_is_named_at_once_with_every_digit(translation_data):
    weights = model(translation_data, "transformer_gcdf", "--gcdf-lambda", "2.718281828", "--input-positions",
                    "sinusoidal").state_dict()
    with pytest.raises(OptionValueError) as refused:
        model(translation_data, "transformer_gcdf").load_state_dict(weights, strict=True)
    assert str(refused.value).startswith(
        "--gcdf-lambda 4, --input-positions none (the defaults): the checkpoint's weights were trained with "
        "--gcdf-lambda 2.718281828 --input-positions sinusoidal; give --gcdf-lambda 2.718281828 --input-positions "
        "sinusoidal to keep them, another value to change them, or --allow-encoding-change"), str(refused.value)
    assert "--model-overrides \"{'gcdf_lambda': 2.718281828, 'input_positions': 'sinusoidal'}\"" in str(refused.value)
    # what the message says to give loads; the input embedding given another way (none: dropped) is taken as meant
    model(translation_data, "transformer_gcdf", "--gcdf-lambda", "2.718281828", "--input-positions",
          "sinusoidal").load_state_dict(weights, strict=True)
    model(translation_data, "transformer_gcdf", "--gcdf-lambda", "2.718281828", "--input-positions",
          "none").load_state_dict(weights, strict=True)


def test_floater_step_size_is_the_step_the_solve_takes(translation_data):
    """The solve takes delta / ceil(delta / step size) steps: step sizes of one step count are one model;
    the default step size follows --floater-delta where that is given another value."""
    dims = ModelDims(embed_dim=16, heads=4, encoder_layers=2, decoder_layers=2)

    def saved(*argv):
        return build_encoding("floater", encoding_options(*argv), dims).state_dict()[trained_with.KEY]

    def check(weights, *argv):
        build_encoding("floater", encoding_options(*argv), dims).check_trained_with(weights)

    check(saved("--floater-step-size", "0.021"))  # 5 steps per position, as the default's 0.02
    with pytest.raises(OptionValueError, match=r"^--floater-step-size 0.02 \(the default\): .* trained with "
                                               r"--floater-step-size 0.05;"):
        check(saved("--floater-step-size", "0.05"), "--floater-delta", "0.1")  # delta given, at its trained value
    check(saved(), "--floater-delta", "0.2")  # another delta (an override for longer positions): the step follows
    check(saved("--floater-method", "dopri5", "--floater-step-size", "0.05"), "--floater-method", "dopri5")  # (no step)


@pytest.mark.parametrize("arch, task, size", [
    ("roberta_gcdf", "masked_lm", TINY_ROBERTA),
    ("transformer_lm_gcdf", "language_modeling", ["--decoder-layers", "2", "--decoder-embed-dim", "32",
                                                  "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4"]),
])
def test_roberta_and_the_language_model_check_it_too(masked_lm_data, arch, task, size):
    """Their fine-tuning (GLUE, RACE; a language model's) goes through --restore-file as well."""
    weights = build_model(masked_lm_data, arch, [*size, "--gcdf-lambda", "2"], task=task)[0].state_dict()
    with pytest.raises(OptionValueError, match=r"^--gcdf-lambda 4 \(the default\): the checkpoint's weights were "
                                               r"trained with --gcdf-lambda 2; give --gcdf-lambda 2 to keep it"):
        build_model(masked_lm_data, arch, size, task=task)[0].load_state_dict(weights, strict=True)


def test_per_stack_parts_each_check_their_own(translation_data):
    """Encoder and decoder of different sizes have an encoding part each (`PerStackEncoding`)."""
    sizes = ["--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32"]
    weights = model(translation_data, "transformer_gcdf", *sizes).state_dict()
    assert {f"positional_encoding.{part}.{trained_with.KEY}" for part in ("encoder", "decoder")} <= weights.keys()
    other = model(translation_data, "transformer_gcdf", *sizes, "--gcdf-lambda", "2").state_dict()
    for part in ("encoder", "decoder"):  # the other part's entry as trained with lambda 2
        key = f"positional_encoding.{part}.{trained_with.KEY}"
        with pytest.raises(OptionValueError, match=r"^--gcdf-lambda 4 \(the default\)"):
            model(translation_data, "transformer_gcdf", *sizes).load_state_dict({**weights, key: other[key]})


def test_averaged_entries_read_back_and_mixed_ones_are_refused(translation_data):
    """fairseq's average_checkpoints sums every entry and divides, its EMA decays each: equal entries give
    themselves back; entries of differently built models give no entry of this package, and say so."""
    first = model(translation_data, "transformer_t5", "--t5-max-distance", "64").state_dict()[KEY]
    second = model(translation_data, "transformer_t5", "--t5-max-distance", "32").state_dict()[KEY]
    assert trained_with.read((first + first + first) / 3) == trained_with.read(first)
    assert trained_with.read(first * 0.999 + first * (1 - 0.999)) == trained_with.read(first)  # (fairseq's EMA step)
    # --ema-fp32 keeps one copy and steps it every update: each step rounds (0.0155 after 30,000 steps at
    # fairseq's default decay, which the former 0.01 tolerance refused)
    kept = first.clone()
    for _ in range(30000):
        kept.mul_(0.9999).add_(first, alpha=1 - 0.9999)
    assert (kept - first).abs().max() > 0.01 and trained_with.read(kept) == trained_with.read(first)
    with pytest.raises(OptionValueError, match="entry is unreadable .* averaged"):
        trained_with.read((first + second) / 2)
    # where every byte's average is a whole number ('5' and '7' average to '6'), the text reads as a third
    # entry; its digest does not match it
    base500, base700 = (model(translation_data, "transformer_rotary", "--rotary-base", base).state_dict()[KEY]
                        for base in ("500", "700"))
    text = ((base500 + base700) / 2)[:-trained_with.DIGEST_BYTES]
    assert b'"rotary_base": 600.0' in bytes(text.to(torch.uint8).tolist())
    with pytest.raises(OptionValueError, match=r"entry is unreadable \(its digest differs\)"):
        trained_with.read(torch.cat([text, base500[-trained_with.DIGEST_BYTES:]]))
    with pytest.raises(OptionValueError, match=r"entry is unreadable"):
        trained_with.read((base500 + base700) / 2)


def restore(data, checkpoint, *options):
    """fairseq-train --restore-file for one update; the finished process."""
    save_dir = tempfile.TemporaryDirectory()  # (fairseq-train makes its save folder even with --no-save)
    command = [str(BIN / "fairseq-train"), str(data), "--user-dir", USER_DIR, *TINY_TRANSFORMER, *QUICK_TRAIN,
               "--max-update", "3", "--no-save", "--save-dir", save_dir.name, "--restore-file", str(checkpoint),
               "--reset-optimizer",
               "--reset-dataloader", "--reset-meters", *options]
    with save_dir:
        return subprocess.run(command, capture_output=True, text=True, env=command_env())


def test_fairseq_train_restore_file_without_the_trained_option_is_refused(translation_data, tiny_checkpoint):
    checkpoint = tiny_checkpoint("transformer_t5", "--t5-max-distance", "64", "--t5-num-buckets", "16")
    done = restore(translation_data, checkpoint, "--arch", "transformer_t5", "--t5-num-buckets", "16")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: Cannot load model parameters") and \
        "--t5-max-distance 128 (the default): the checkpoint's weights were trained with --t5-max-distance 64" in last
    done = restore(translation_data, checkpoint, "--arch", "transformer_t5", "--t5-num-buckets", "16",
                   "--t5-max-distance", "64")
    assert done.returncode == 0, done.stderr[-3000:]
    done = restore(translation_data, checkpoint, "--arch", "transformer_t5", "--t5-num-buckets", "16",
                   "--allow-encoding-change")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_stored_config_whose_default_changed_is_refused_and_overrides_load_it(translation_data, tiny_checkpoint,
                                                                                 tmp_path):
    """A checkpoint's config leaves out options given at their default; were a default to change, the
    stored model would load as another one. Its entry says so; --model-overrides gives the value back."""
    from fairseq import checkpoint_utils

    checkpoint = tiny_checkpoint("transformer_t5", "--t5-max-distance", "64", "--t5-num-buckets", "16")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    (original,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    state["cfg"]["model"].t5_max_distance = None  # as if saved by a version whose default was 64
    edited = tmp_path / "edited.pt"
    torch.save(state, edited)
    with pytest.raises(OptionValueError, match=r"--model-overrides \"\{'t5_max_distance': 64\}\""):
        checkpoint_utils.load_model_ensemble([str(edited)])
    (overridden,), _ = checkpoint_utils.load_model_ensemble([str(edited)], arg_overrides={"t5_max_distance": 64})
    assert torch.equal(outputs(overridden, task), outputs(original, task))
    assert checkpoint.read_bytes() != edited.read_bytes()


def test_training_and_saving_keep_the_entry_through_fairseq(translation_data, tiny_checkpoint):
    checkpoint = tiny_checkpoint("transformer_t5", "--t5-max-distance", "64", "--t5-num-buckets", "16")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"][KEY]
    assert trained_with.read(saved) == {"encoding": "t5", "options": {
        "input_positions": "none", "scalar_bias_layers": "first", "t5_max_distance": 64, "t5_num_buckets": 16}}


def test_weights_of_other_shapes_are_refused_without_a_way_out_that_cannot_load_them(translation_data):
    """An option that sizes the tables (--t5-num-buckets) or another encoding with tables: the refusal
    names what the weights were trained with and does not offer --allow-encoding-change or another
    value, which would end in torch's size mismatch; with the flag given, the shapes are refused in one
    line naming them (before: torch's missing/unexpected keys and size mismatch, as a traceback)."""
    t5_16 = model(translation_data, "transformer_t5", "--t5-num-buckets", "16").state_dict()
    with pytest.raises(OptionValueError, match=r"^--t5-num-buckets 32 \(the default\): the checkpoint's weights were "
                                               r"trained with --t5-num-buckets 16; give --t5-num-buckets 16 \(the "
                                               r"encoding's weights differ from this model's in shape: "
                                               r"--allow-encoding-change cannot load them\)"):
        load_with_config(translation_data, t5_16, "transformer_t5")
    with pytest.raises(OptionValueError, match=r"^the checkpoint's positional-encoding weights do not fit this "
                                               r"model's \(positional_encoding\.\S+ of shape \[16, 4\] in the "
                                               r"checkpoint, \[32, 4\] here.*\): build the model with the encoding "
                                               r"options the weights were trained with \(t5 with .*--t5-num-buckets "
                                               r"16.*\)$"):
        load_with_config(translation_data, t5_16, "transformer_t5", "--allow-encoding-change")
    load_with_config(translation_data, t5_16, "transformer_t5", "--t5-num-buckets", "16")
    with pytest.raises(OptionValueError, match=r"^the checkpoint's weights were trained with the t5 encoding, not "
                                               r"alibi: .*--positional-encoding t5\) \(the encoding's weights differ"):
        load_with_config(translation_data, t5_16, "transformer_alibi")


def test_a_stock_checkpoint_into_an_encoding_with_weights_names_the_converter(translation_data):
    """Stock fairseq weights have none of the encoding's parameters: the one line names the converter
    (before: torch's missing keys as a traceback). Parameter-free encodings load them as before."""
    stock = build_model(translation_data, "transformer", TINY_TRANSFORMER)[0].state_dict()
    with pytest.raises(OptionValueError, match=r"^the checkpoint has none of this model's positional-encoding "
                                               r"weights \(positional_encoding\.\S+, \.\.\.\): a stock fairseq "
                                               r"checkpoint is converted first \(scripts/convert_transformer_"
                                               r"checkpoint\.py, docs/conversion\.md\)$"):
        load_with_config(translation_data, stock, "transformer_t5")
    load_with_config(translation_data, stock, "transformer_alibi", "--input-positions", "stock")


def test_weights_that_load_keep_their_way_out_and_other_load_errors_stay_torchs(translation_data):
    """Only what torch's load itself refuses, and only where every key it names is an encoding's, is told
    as the encoding's: FLOATER's saved K-window (extra state its load takes) does not make weights of
    another --floater-delta unloadable, and a wrong embedding size stays torch's own size mismatch (before:
    both were told as encoding weights that do not fit)."""
    windowed = model(translation_data, "transformer_floater", "--floater-recompute-every", "4",
                     "--floater-delta", "0.2").state_dict()
    with pytest.raises(OptionValueError, match=r"give --floater-delta 0\.2 to keep it, another value to change it, "
                                               r"or --allow-encoding-change"):
        load_with_config(translation_data, windowed, "transformer_floater")
    load_with_config(translation_data, windowed, "transformer_floater", "--allow-encoding-change")
    load_with_config(translation_data, windowed, "transformer_floater", "--floater-delta", "0.2")
    wider = dict(windowed)
    wider["encoder.embed_tokens.weight"] = torch.cat([wider["encoder.embed_tokens.weight"]] * 2)
    with pytest.raises(RuntimeError, match=r"size mismatch for encoder\.embed_tokens\.weight") as raised:
        load_with_config(translation_data, wider, "transformer_floater", "--floater-delta", "0.2")
    assert not isinstance(raised.value, OptionValueError)


def test_a_load_error_naming_other_keys_besides_the_encodings_stays_torchs(translation_data):
    """The encoding's one line is for a load whose every failing key is the encoding's: a stock checkpoint
    that also has an embedding of another size fails on that embedding too, so it stays torch's own
    error, naming both (not "converted first", which would hide the size mismatch)."""
    stock = build_model(translation_data, "transformer", TINY_TRANSFORMER)[0].state_dict()
    stock["encoder.embed_tokens.weight"] = torch.cat([stock["encoder.embed_tokens.weight"]] * 2)
    with pytest.raises(RuntimeError, match=r"size mismatch for encoder\.embed_tokens\.weight") as raised:
        load_with_config(translation_data, stock, "transformer_t5")
    assert not isinstance(raised.value, OptionValueError)
    assert "positional_encoding." in str(raised.value)  # (the encoding's missing keys too: a mixed error)
