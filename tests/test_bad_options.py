"""Every bad option value of the T5/AT5/Shaw/LFHC/XL/GCDF/ALiBi/rotary/FLOATER encodings ends in one clear
line naming the option (issue 12), wherever the value comes from:

- the command line (argparse `type=` / `choices=` / actions, as fairseq parses `add_args`):
  exit status 2, `argument --OPTION: ...`, no traceback;
- a Namespace (a stored config, the converters' overrides, code that builds models directly):
  `OptionValueError` (a ValueError) naming `--OPTION` and the value, before any parameter exists.

Edge values that mean something (0 where meaningful) are honoured, not replaced by the default.
"""
import argparse
import os
import subprocess
import sys

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.encodings import ENCODINGS, ModelDims, build_encoding
from posenc_fairseq.encodings.option_types import (MAX_PARAMETER_BYTES, OptionValueError, check_size,
                                                   even_int_in_range, flag, flag_name, float_in_range, int_in_range,
                                                   option, option_pair, positive_float, probability)
from position_terms import logits_between
from util import USER_DIR, encoding_options

DIMS = ModelDims(embed_dim=16, heads=4, encoder_layers=2, decoder_layers=2)


def check_encoding_options(name: str, args, dims) -> None:
    """Every check the encoding `name` makes when it is built, on torch's meta device: nothing is
    allocated, so even a refused huge table costs nothing to check."""
    with torch.device("meta"):
        build_encoding(name, args, dims)

# (encoding to build, command-line arguments): every one refused at parse time and at build time
BAD = [
    # Shaw / LFHC: k >= 1 (k = 0 was silently 16), bounded table size
    ("shaw", ["--shaw-k", "0"]),
    ("shaw", ["--shaw-k", "-2"]),
    ("shaw", ["--shaw-k", "1000000000"]),
    ("shaw", ["--shaw-k", "2.5"]),
    ("shaw", ["--shaw-k", "many"]),
    ("shaw", ["--shaw-values", "maybe"]),
    ("lfhc", ["--lfhc-k", "0"]),
    ("lfhc", ["--lfhc-k", "1000000000"]),
    ("lfhc", ["--lfhc-values", "2"]),
    ("lfhc", ["--lfhc-rounding", "ceil"]),
    # T5 / T5-NoB: even bucket count >= 4 (0 was silently 32; odd leaves a row unused)
    ("t5", ["--t5-num-buckets", "0"]),
    ("t5", ["--t5-num-buckets", "7"]),
    ("t5", ["--t5-num-buckets", "2"]),
    ("t5", ["--t5-num-buckets", "-4"]),
    ("t5", ["--t5-num-buckets", "1000000000"]),
    ("t5", ["--t5-max-distance", "-1"]),
    ("t5_nob", ["--t5-max-distance", "-3"]),
    ("t5_nob", ["--t5-max-distance", "1000000000"]),
    ("t5", ["--scalar-bias-layers", "some"]),
    # AT5 / AT5-NoB
    ("at5", ["--at5-length-scale", "0"]),
    ("at5", ["--at5-length-scale", "-5"]),
    ("at5", ["--at5-length-scale", "0.5"]),
    ("at5", ["--at5-length-scale", "nan"]),
    ("at5", ["--at5-length-scale", "inf"]),
    ("at5", ["--at5-gamma-range", "10", "1"]),
    ("at5", ["--at5-gamma-range", "nan", "1"]),
    ("at5", ["--at5-gamma-range", "-1", "5"]),
    ("at5", ["--at5-gamma-range", "0", "0"]),
    ("at5", ["--at5-gamma-range", "1", "1e9"]),
    ("at5", ["--at5-mlp-widths", "0", "4"]),
    ("at5", ["--at5-mlp-widths", "32", "-1"]),
    ("at5", ["--at5-mlp-widths", "100000", "4"]),
    ("at5", ["--at5-dropout", "1"]),
    ("at5", ["--at5-dropout", "-0.1"]),
    ("at5", ["--at5-dropout", "nan"]),
    ("at5", ["--at5-activation", "softmax"]),
    ("at5", ["--at5-gamma-init", "log"]),
    ("at5_nob", ["--at5-nob-input", "bucket"]),
    ("at5_nob", ["--at5-length-scale", "0"]),
    # rotary, GCDF
    ("rotary", ["--rotary-base", "0"]),
    ("rotary", ["--rotary-base", "-1"]),
    ("rotary", ["--rotary-base", "nan"]),
    ("rotary", ["--rotary-base", "inf"]),
    ("gcdf", ["--gcdf-lambda", "nan"]),
    ("gcdf", ["--gcdf-lambda", "inf"]),
    ("gcdf", ["--gcdf-lambda", "-1"]),
    ("gcdf", ["--gcdf-lambda", "0"]),
    ("gcdf", ["--gcdf-lambda", "1e9"]),
    # FLOATER: Delta and step in (0, 1000] (0 divided by zero, 1e9 overflowed to NaN), tolerance in (0, 1)
    ("floater", ["--floater-max-speed", "0"]),
    ("floater", ["--floater-max-speed", "-1"]),
    ("floater", ["--floater-max-speed", "nan"]),
    ("floater", ["--floater-max-speed", "1e9"]),
    ("floater", ["--floater-decay", "-1"]),
    ("floater", ["--floater-decay", "nan"]),
    ("floater", ["--floater-decay", "1e9"]),
    ("floater", ["--floater-stop-position", "0"]),
    ("floater", ["--floater-stop-position", "-3"]),
    ("floater", ["--floater-stop-position", "1.5"]),
    ("floater", ["--floater-delta", "0"]),
    ("floater", ["--floater-delta", "-0.1"]),
    ("floater", ["--floater-delta", "nan"]),
    ("floater", ["--floater-delta", "inf"]),
    ("floater", ["--floater-delta", "1e9"]),
    ("floater", ["--floater-step-size", "0"]),
    ("floater", ["--floater-step-size", "-1"]),
    ("floater", ["--floater-step-size", "nan"]),
    ("floater", ["--floater-tolerance", "0"]),
    ("floater", ["--floater-tolerance", "-1"]),
    ("floater", ["--floater-tolerance", "1"]),
    ("floater", ["--floater-tolerance", "nan"]),
    ("floater", ["--floater-hidden", "0"]),
    ("floater", ["--floater-hidden", "-3"]),
    ("floater", ["--floater-hidden", "100000"]),
    ("floater", ["--floater-recompute-every", "0"]),
    ("floater", ["--floater-recompute-every", "-1"]),
    ("floater", ["--floater-method", "rk45"]),
    ("floater", ["--floater-init", "big"]),
    ("floater", ["--floater-dynamics-lr-scale", "0"]),
    ("floater", ["--floater-dynamics-lr-scale", "-1"]),
    ("floater", ["--floater-dynamics-lr-scale", "nan"]),
    ("floater", ["--floater-dynamics-lr-scale", "1e9"]),
]

# values that only the combination with other options or the model's size makes bad: refused
# when the encoding is built, with the computed figure where it is a size
BAD_AT_BUILD = [
    ("t5", {"t5_max_distance": 16}, "--t5-max-distance 16: expected an integer > 16"),
    ("t5", {"t5_num_buckets": 64, "t5_max_distance": 0}, "--t5-max-distance 0"),
    ("shaw", {"shaw_k": 65536}, "would take"),  # with a big model (below): figure in bytes
    ("at5_nob", {"at5_nob_input": "learned", "at5_length_scale": 1e9}, "would take"),
    ("at5", {"at5_gamma_init": "geometric", "at5_gamma_range": [0.0, 10.0]}, "expected MIN > 0"),
    # a step that would take 10^6 solver steps per position (it hung for minutes using 6 GB)
    ("floater", {"floater_step_size": 1e-7}, "--floater-step-size 1e-07: 1000000 solver steps per position"),
    ("floater", {"floater_freeze_dynamics": True, "floater_train_dynamics_only": True}, "exclude each other"),
    ("floater", {"floater_dynamics_lr_scale": 10.0, "optimizer": "adam"}, "composite optimizer"),
    # (before, ignored without a word under the composite optimizer)
    ("floater", {"floater_dynamics_lr_scale": 10.0, "floater_freeze_dynamics": True, "optimizer": "composite"},
     "--floater-dynamics-lr-scale with --floater-freeze-dynamics: h is not trained"),
]
BIG = ModelDims(embed_dim=1024, heads=16, encoder_layers=24, decoder_layers=24)


def option_of(argv):
    return argv[0]


def parser():
    """The encodings' options on a parser that behaves like fairseq's (errors exit with status 2)."""
    from posenc_fairseq.models.common import add_position_args

    result = argparse.ArgumentParser(prog="fairseq-train")
    add_position_args(result)
    return result


def typed(argv):
    """The Namespace value a config would hold for `argv` (numbers as numbers, pairs as lists)."""
    def number(text):
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    values = [number(part) for part in argv[1:]]
    return argv[0][2:].replace("-", "_"), values[0] if len(values) == 1 else values


@pytest.mark.parametrize("name,argv", BAD, ids=[" ".join(argv) for _, argv in BAD])
def test_bad_value_refused_on_the_command_line(name, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["--positional-encoding", name, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: argument " + option_of(argv)), err
    assert "expected" in last or "invalid choice" in last, last
    assert "Traceback" not in err


@pytest.mark.parametrize("name,argv", BAD, ids=[" ".join(argv) for _, argv in BAD])
def test_bad_value_refused_when_building_from_a_namespace(name, argv):
    dest, value = typed(argv)
    args = encoding_options(**{dest: value})
    torch.manual_seed(0)
    with pytest.raises(OptionValueError) as error:
        build_encoding(name, args, DIMS)
    message = str(error.value)
    assert message.startswith(option_of(argv)) and "\n" not in message, message
    assert "expected" in message or "would take" in message, message


@pytest.mark.parametrize("name,options,expected", BAD_AT_BUILD, ids=[name for name, _, _ in BAD_AT_BUILD])
def test_bad_combination_or_size_refused_when_building(name, options, expected):
    dims = BIG if "would take" in expected else DIMS
    with pytest.raises(OptionValueError, match=expected.replace("+", r"\+")) as error:
        build_encoding(name, encoding_options(**options), dims)
    message = str(error.value)
    if "would take" in expected:  # the computed figure and the limit
        assert "GiB" in message and "the limit is 1.0 GiB" in message, message
    # the same check before anything is built, allocating nothing (meta device)
    with pytest.raises(OptionValueError, match=expected.replace("+", r"\+")):
        check_encoding_options(name, encoding_options(**options), dims)


def test_check_encoding_options_accepts_good_ones_for_a_big_model():
    for name in sorted(ENCODINGS):
        check_encoding_options(name, encoding_options(), BIG)


def test_shaw_size_figure_is_computed():
    """k = 65536 in a 24+24-layer model with 64-dim heads: 2 tables a layer of 131073 x 64 floats."""
    with pytest.raises(OptionValueError) as error:
        build_encoding("shaw", encoding_options(shaw_k=65536), BIG)
    values = 2 * 48 * 131073 * 64
    assert f"{values * 4 / 2 ** 30:.1f} GiB" in str(error.value) and f"({values:,} values)" in str(error.value)


# --- edge values that mean something are honoured, not replaced by the default -------------
def test_t5_nob_max_distance_zero_clips_every_distance():
    encoding = build_encoding("t5_nob", encoding_options(t5_max_distance=0), DIMS)
    assert encoding.max_distance == 0 and encoding.tables["encoder"].shape == (1, 4)
    assert encoding.tables["decoder"].shape == (1, 4)
    bias = logits_between(encoding, "encoder", 0, None, None, torch.arange(5), torch.arange(5))
    assert (bias == bias[:, :1, :1]).all()  # one value per head for every distance


def test_smallest_allowed_values_are_honoured():
    assert build_encoding("shaw", encoding_options("--shaw-k", "1"), DIMS).key_tables["encoder0"].shape == (3, 4)
    t5 = build_encoding("t5", encoding_options("--t5-num-buckets", "4", "--t5-max-distance", "3"), DIMS)
    assert t5.num_buckets == 4 and t5.max_distance == 3 and t5.tables["encoder"].shape == (4, 4)
    at5 = build_encoding("at5", encoding_options("--at5-length-scale", "1", "--at5-gamma-range", "0", "0.5",
                                                 "--at5-gamma-init", "uniform", "--at5-mlp-widths", "1", "1",
                                                 "--at5-dropout", "0"), DIMS)
    assert at5.length_scale == 1.0 and at5.mlps["encoder_minus"].w2.shape == (4, 1, 1)
    gammas = torch.cat([at5.gamma(name) for name in at5.raw_gammas])
    assert (gammas >= 0).all() and (gammas <= 0.5).all()
    assert build_encoding("rotary", encoding_options("--rotary-base", "1"), DIMS).base == 1.0
    assert build_encoding("gcdf", encoding_options("--gcdf-lambda", "0.001"), DIMS).scale == 0.001


def test_namespace_zero_is_judged_not_replaced_by_the_default():
    """A config holding 0 (as fairseq stores it) is refused, never silently the default."""
    for name, dest in (("shaw", "shaw_k"), ("lfhc", "lfhc_k"), ("t5", "t5_num_buckets"),
                       ("at5", "at5_length_scale"), ("rotary", "rotary_base"), ("gcdf", "gcdf_lambda")):
        with pytest.raises(OptionValueError, match="--" + dest.replace("_", "-") + " 0:"):
            build_encoding(name, encoding_options(**{dest: 0}), DIMS)
    # and absent (None) is the default
    assert build_encoding("shaw", encoding_options(), DIMS).k == 16


@pytest.mark.parametrize("name,dest,read", [
    ("floater", "floater_autonomous", lambda encoding: encoding.autonomous),
    ("floater", "floater_first_block_only", lambda encoding: encoding.first_block_only),
    ("floater", "floater_adjoint", lambda encoding: encoding.adjoint),
    ("floater", "floater_freeze_dynamics", lambda encoding: encoding.freeze_dynamics),
    ("shaw", "shaw_values", lambda encoding: encoding.values),
    ("t5", "scalar_bias_share_layers", lambda encoding: encoding.share_layers),
])
def test_on_off_options_in_a_config_are_read_by_meaning_not_truthiness(name, dest, read):
    """A string such as --model-overrides "{'floater_autonomous': 'false'}" gives: 'false' is off (a
    non-empty string, it was once read as on), 'maybe' is refused naming the option."""
    extra = {"scalar_bias_layers": "all"} if dest == "scalar_bias_share_layers" else {}
    for given_value, meaning in (("false", False), ("off", False), ("true", True), ("on", True), (False, False)):
        torch.manual_seed(0)
        assert read(build_encoding(name, encoding_options(**{dest: given_value}, **extra), DIMS)) is meaning
    with pytest.raises(OptionValueError, match="^" + flag_name(dest) + " maybe: expected on/off"):
        build_encoding(name, encoding_options(**{dest: "maybe"}, **extra), DIMS)


def test_every_encoding_option_has_a_checked_type():
    """No option of these encodings takes a bare int/float (which accepts 0, nan, -1 ...)."""
    prefixes = ("--t5-", "--scalar-bias-", "--at5-", "--shaw-", "--lfhc-", "--gcdf-", "--rotary-", "--xl-", "--alibi-")
    seen = 0
    for action in parser()._actions:
        if not any(name.startswith(prefixes) for name in action.option_strings):
            continue
        seen += 1
        if action.choices is None and action.nargs != 0:
            assert action.type not in (int, float, None), f"{action.option_strings} has type {action.type}"
    assert seen == 18  # scalar-bias 2, t5 2, at5 7, shaw 2, lfhc 3, gcdf 1, rotary 1


# --- the checkers themselves ------------------------------------------------------------------
@pytest.mark.parametrize("checker,good,bad", [
    (int_in_range(1, 10), ["1", "10", 5, 7.0], ["0", "11", "1.5", "x", True, None, 2.5]),
    (even_int_in_range(4), ["4", "6", 100], ["5", "2", "-4"]),
    (float_in_range(0.0, 1.0, high_open=True), ["0", "0.5", 0], ["1", "-0.1", "nan", "inf"]),
    (positive_float, ["1e-9", 3], ["0", "-1", "nan", "-inf", False]),
    (probability, ["0", "0.999"], ["1", "1.5"]),
    (flag, [True, False, "on", "OFF", "true", "False", "yes", "0", 1, 0], ["maybe", "", "2", 2, 0.5, None]),
])
def test_checkers(checker, good, bad):
    for value in good:
        checker(value)
    for value in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            checker(value)


def test_option_helpers():
    args = argparse.Namespace(a=0, b=None, pair=[3.0, 1.0], single=[1.0])
    with pytest.raises(OptionValueError, match=r"^--a 0: expected a finite number > 0$"):
        option(args, "a", positive_float, 5.0)
    assert option(args, "b", positive_float, 5.0) == 5.0
    assert option({"a": "2"}, "a", positive_float, 5.0) == 2.0
    with pytest.raises(OptionValueError, match="MIN <= MAX"):
        option_pair(args, "pair", positive_float, (1, 2), ordered=True)
    with pytest.raises(OptionValueError, match="two values"):
        option_pair(args, "single", positive_float, (1, 2))
    with pytest.raises(OptionValueError, match=r"--x 5: t would take 1\.0 GiB \(268,435,457 values\)"):
        check_size("--x 5", MAX_PARAMETER_BYTES // 4 + 1, "t")
    check_size("--x 5", MAX_PARAMETER_BYTES // 4, "t")



def test_an_ordered_pair_accepts_min_equal_to_max():
    """MIN <= MAX, equality included: `option_pair(..., ordered=True)` (a Namespace) and the
    `ordered_pair` action (the command line) both take 5 5, and AT5 then starts every gamma at 5."""
    assert option_pair(argparse.Namespace(pair=[5.0, 5.0]), "pair", positive_float, (1, 2), ordered=True) == (5.0, 5.0)
    assert parser().parse_args(["--at5-gamma-range", "5", "5"]).at5_gamma_range == [5.0, 5.0]
    for args in (encoding_options("--at5-gamma-range", "5", "5"), encoding_options(at5_gamma_range=[5.0, 5.0])):
        at5 = build_encoding("at5", args, DIMS)
        for name in at5.raw_gammas:
            assert torch.allclose(at5.gamma(name), torch.full((4,), 5.0), rtol=1e-6), name


# --- the real command: fairseq-train stops at parsing, one line, before touching data ---------
@pytest.mark.parametrize("arch,argv", [
    ("transformer_shaw", ["--shaw-k", "0"]),
    ("transformer_at5", ["--at5-gamma-range", "10", "1"]),
    ("roberta_t5", ["--t5-num-buckets", "7"]),
])
def test_fairseq_train_refuses_with_one_line(tmp_path, arch, argv):
    done = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(tmp_path / "no-data"), "--user-dir", USER_DIR,
                           "--arch", arch, "--cpu", *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {argv[0]}" in errors[0], done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,option", [
    (["--arch", "transformer_floater", "--floater-step-size", "1e-7"], "--floater-step-size"),
    (["--arch", "transformer_floater", "--floater-freeze-dynamics", "--floater-train-dynamics-only"],
     "--floater-freeze-dynamics"),
])
def test_bad_combination_ends_fairseq_train_with_one_line(translation_data, tmp_path, argv, option):
    """A value refused only when the model is built (combinations, computed sizes) ends the command
    like an argparse error: one `error:` line naming the option, no traceback, nothing written."""
    from util import BIN, QUICK_TRAIN, TINY_TRANSFORMER
    done = subprocess.run([str(BIN / "fairseq-train"), str(translation_data), "--user-dir", USER_DIR, *argv,
                           *TINY_TRANSFORMER, *QUICK_TRAIN, "--max-update", "1", "--save-dir", str(tmp_path / "save")],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(f"fairseq-train: error: {option}"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())


# --- an option of another encoding: fairseq accepts it (every model has every encoding's options) --------
def test_an_option_of_another_encoding_is_named_when_the_model_is_built(translation_data, masked_lm_data, caplog):
    """Before, `--arch transformer_t5 --floater-method rk4` trained without a word, the option without effect.
    A warning, not a refusal: checkpoints trained so must still load."""
    from util import TINY_TRANSFORMER, build_model

    def warnings_of(arch, *options):
        caplog.clear()
        with caplog.at_level("WARNING", logger="posenc_fairseq"):
            build_model(translation_data, arch, [*TINY_TRANSFORMER, *options])
        return [record.getMessage() for record in caplog.records if record.name.startswith("posenc_fairseq")]

    assert warnings_of("transformer_t5", "--floater-method", "rk4", "--shaw-k", "4") == [
        "--floater-method is an option of floater; this model's encoding, t5, does not read it: it has no effect",
        "--shaw-k is an option of shaw; this model's encoding, t5, does not read it: it has no effect"]
    assert warnings_of("transformer_lfhc", "--shaw-values", "off") == [
        "--shaw-values is an option of shaw; this model's encoding, lfhc, does not read it: it has no effect"]
    assert warnings_of("transformer_floater", "--floater-method", "rk4") == []
    assert warnings_of("transformer_at5_nob", "--scalar-bias-layers", "all", "--at5-dropout", "0.1") == []
    assert warnings_of("transformer_t5") == []
    # the language models too (decoder-only; they warned of nothing before)
    caplog.clear()
    with caplog.at_level("WARNING", logger="posenc_fairseq"):
        build_model(masked_lm_data, "transformer_lm_t5", ["--decoder-layers", "1", "--decoder-embed-dim", "16",
                                                           "--decoder-attention-heads", "2", "--shaw-k", "4"],
                    task="language_modeling")
    assert [record.getMessage() for record in caplog.records if record.name.startswith("posenc_fairseq")] == [
        "--shaw-k is an option of shaw; this model's encoding, t5, does not read it: it has no effect"]


# --- a misspelt option in a config: --model-overrides, hub keywords, arg_overrides set any name ---------
def test_a_misspelt_option_in_a_config_is_refused_naming_the_option():
    args = encoding_options(floater_stop_positon=64)
    with pytest.raises(OptionValueError, match=r"^--floater-stop-positon: no encoding has this option \(did you mean "
                                               r"--floater-stop-position\?\); a name given to --model-overrides"):
        build_encoding("floater", args, DIMS)
    with pytest.raises(OptionValueError, match=r"^--t5-max-distanse: .*did you mean --t5-max-distance\?"):
        build_encoding("t5", {"t5_max_distanse": 64}, DIMS)  # (a dict config, and another encoding's name)
    # unset (None), or of a form no encoding's options have (xl_*: XL has none; fairseq's own names): not judged
    build_encoding("floater", encoding_options(floater_stop_positon=None, xl_clamp=3, encoder_layers=2), DIMS)


def test_fairseq_generate_refuses_a_misspelt_model_override_in_one_line(translation_data, tiny_checkpoint):
    from util import BIN
    checkpoint = tiny_checkpoint("transformer_t5", "--t5-max-distance", "64", "--t5-num-buckets", "16")
    done = subprocess.run([str(BIN / "fairseq-generate"), str(translation_data), "--user-dir", USER_DIR,
                           "--path", str(checkpoint), "--cpu", "--max-tokens", "2000", "--beam", "1",
                           "--model-overrides", "{'t5_max_distanse': 256}"],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "error: --t5-max-distanse: no encoding has this option (did you mean --t5-max-distance?)" in last, last


def test_a_misspelt_general_option_or_an_unknown_encoding_in_a_config_is_refused():
    """The package's own options (--input-positions, --positional-encoding, --allow-encoding-change) set
    through --model-overrides or hub keywords: a misspelling was ignored silently, an unknown encoding
    name ended in a bare KeyError."""
    import argparse

    from posenc_fairseq.encodings.base import GENERAL_OPTIONS
    from posenc_fairseq.models.common import add_position_args, set_position_defaults

    with pytest.raises(OptionValueError, match=r"^--input-position: .*did you mean --input-positions\?"):
        build_encoding("t5", encoding_options(input_position="learned"), DIMS)
    with pytest.raises(OptionValueError, match=r"^--positional-encodng: .*did you mean --positional-encoding\?"):
        build_encoding("t5", {"positional_encodng": "alibi"}, DIMS)
    build_encoding("t5", {"input_positions": "learned", "allow_encoding_change": True}, DIMS)
    with pytest.raises(OptionValueError, match=r"^--positional-encoding bogus: expected one of alibi, at5, "):
        set_position_defaults(argparse.Namespace(positional_encoding="bogus"), "t5")
    # an empty name is refused too, not replaced by the architecture's encoding; None is the architecture's
    with pytest.raises(OptionValueError, match=r"^--positional-encoding : expected one of alibi, "):
        set_position_defaults(argparse.Namespace(positional_encoding=""), "t5")
    defaults = argparse.Namespace(positional_encoding=None)
    set_position_defaults(defaults, "t5")
    assert defaults.positional_encoding == "t5"
    with pytest.raises(OptionValueError, match=r"^--positional-encoding bogus: expected one of alibi, "):
        build_encoding("bogus", encoding_options(), DIMS)
    # the general options named in encodings/base.py are those the models add
    parser = argparse.ArgumentParser()
    add_position_args(parser)
    general = {action.dest for action in parser._actions} - set(vars(encoding_options())) - {"help"}
    assert general == GENERAL_OPTIONS


def test_a_roberta_architecture_on_a_translation_task_is_refused(translation_data):
    """An encoder of one sequence built for a task of pairs (fairseq-train's default task, translation)
    trained without a word when its input embedding read no maximum (--input-positions none); stock
    RoBERTa fails there on a tuple (a traceback)."""
    from util import TINY_ROBERTA, build_model

    with pytest.raises(OptionValueError, match=r"^--arch roberta_t5: RoBERTa reads one sequence, but --task "
                                               r"translation gives pairs \(max positions \(\d+, \d+\)\): use a "
                                               r"single-sequence task"):
        build_model(translation_data, "roberta_t5", TINY_ROBERTA)


def test_an_option_of_the_same_family_that_the_encoding_does_not_read_is_named(translation_data, caplog):
    """Options shared by a family (t5/t5_nob, at5/at5_nob, FLOATER's solvers) that the encoding as built
    does not read were accepted without a word; dopri5 with a tiny step was refused for a step count it
    never takes."""
    from util import TINY_TRANSFORMER, build_model

    def warnings_of(arch, *options):
        caplog.clear()
        with caplog.at_level("WARNING", logger="posenc_fairseq"):
            build_model(translation_data, arch, [*TINY_TRANSFORMER, *options])
        return [record.getMessage() for record in caplog.records if record.name.startswith("posenc_fairseq")]

    assert warnings_of("transformer_t5_nob", "--t5-num-buckets", "16") == [
        "--t5-num-buckets has no effect: t5_nob has no buckets"]
    assert warnings_of("transformer_at5_nob", "--at5-gamma-range", "1", "5", "--at5-gamma-init", "uniform") == [
        "--at5-gamma-range has no effect: at5_nob has no gamma", "--at5-gamma-init has no effect: at5_nob has no gamma"]
    assert warnings_of("transformer_at5", "--at5-nob-input", "learned") == [
        "--at5-nob-input has no effect: only at5_nob reads it"]
    assert warnings_of("transformer_t5", "--scalar-bias-share-layers") == [
        "--scalar-bias-share-layers has no effect: it shares the tables of --scalar-bias-layers all"]
    assert warnings_of("transformer_t5", "--scalar-bias-share-layers", "--scalar-bias-layers", "all") == []
    assert warnings_of("transformer_floater", "--floater-tolerance", "1e-3") == [
        "--floater-tolerance has no effect: only --floater-method dopri5 reads it"]
    assert warnings_of("transformer_floater", "--floater-method", "dopri5", "--floater-step-size", "1e-7") == [
        "--floater-step-size has no effect: dopri5 chooses its own steps (--floater-tolerance)"]
    assert warnings_of("transformer_floater", "--floater-method", "dopri5", "--floater-tolerance", "1e-3") == []
