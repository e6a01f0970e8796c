"""What an encoding's weights were trained with, kept in their state dict and checked on a strict load.

fairseq-train builds the model for --restore-file from its command line, not from the checkpoint's
config. An encoding option left out there (--t5-max-distance, --gcdf-lambda, --rotary-base ...), or
another parameter-free encoding (alibi weights under a rotary architecture), would give the weights
another encoding than the one they were trained with wherever the parameter shapes agree, silently.
So every encoding saves under `{prefix}trained_with` its name and the values of the options that
define what it computes (`PositionalEncoding.defining_option`), and a strict load refuses, in one
line, weights trained with another encoding, or with another value of an option that the model has
only by default. A value given (command line, --model-overrides) is taken as meant, and so are the
weights as they are with --allow-encoding-change (a deliberate change, e.g. from first-block-only FLOATER
weights to every block). Options of training alone (FLOATER's recompute interval, initialisations,
dropout) are not kept. Checkpoints without the entry (stock fairseq's, older ones) load as before.

The entry is a float tensor of the UTF-8 bytes of a JSON object: fairseq's checkpoint averaging and
EMA treat every state-dict entry as a floating tensor (EMA multiplies each by its decay); equal entries
average to themselves, to within rounding, and are read back rounded.
"""
import json
from typing import Dict, NamedTuple, Tuple

import torch
from torch import Tensor

from .option_types import OptionValueError, flag_name

#: the state-dict key of the entry, under the encoding's prefix
KEY = "trained_with"


class DefiningOption(NamedTuple):
    """An option that defines what an encoding computes, as the encoding read it."""
    value: object  # the value computed with (a number, string, bool, pair or None)
    given: bool  # whether the model's config gave it (else the option's default)
    follows: Tuple[str, ...] = ()  # the options a computed default follows (given with another value: so is this)


def entry(name: str, options: Dict[str, DefiningOption]) -> Tensor:
    """The state-dict entry of encoding `name` built with `options`."""
    text = json.dumps({"encoding": name, "options": {dest: option.value for dest, option in options.items()}},
                      sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.float32)


def read(saved) -> dict:
    """{"encoding": name, "options": {dest: value}} from a saved entry; OptionValueError where it is
    not one (checkpoints of differently built models averaged, say)."""
    try:
        codes = torch.as_tensor(saved).detach().double()
        rounded = codes.round()  # (EMA's x * d + x * (1 - d) is x to within rounding)
        if codes.dim() != 1 or not bool(((rounded >= 0) & (rounded <= 255) & ((codes - rounded).abs() < 0.01)).all()):
            raise ValueError("not byte values")
        trained = json.loads(bytes(rounded.to(torch.uint8).tolist()).decode())
        if not isinstance(trained.get("encoding"), str) or not isinstance(trained.get("options"), dict):
            raise ValueError("not an encoding and its options")
    except (ValueError, TypeError, AttributeError, RuntimeError) as error:
        raise OptionValueError(f"the checkpoint's positional_encoding {KEY} entry is unreadable ({error}): it was not "
                               "saved by this package from one model (checkpoints of differently built models "
                               "averaged?)") from None
    return trained


def _exact(value) -> str:
    """A number as given on a command line, every digit kept (64, 2.718281828)."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


def shown(dest: str, value) -> str:
    """The command-line form of option `dest` at `value` ('--t5-max-distance 64', '--floater-autonomous',
    'no --floater-stop-position')."""
    if value is True:
        return flag_name(dest)
    if value is False or value is None:
        return f"no {flag_name(dest)}"
    values = value if isinstance(value, (list, tuple)) else [value]
    return " ".join([flag_name(dest), *(_exact(item) for item in values)])


def _same(value, trained) -> bool:
    return json.loads(json.dumps(value)) == trained


def check(saved, name: str, options: Dict[str, DefiningOption]) -> None:
    """Refuse (OptionValueError, one line) the saved entry of weights trained with another encoding
    than `name`, or with other values of options that `options` hold by default (all of them named)."""
    trained = read(saved)
    way_out = "or --allow-encoding-change to load the weights as they are"
    if trained["encoding"] != name:
        raise OptionValueError(
            f"the checkpoint's weights were trained with the {trained['encoding']} encoding, not {name}: give the "
            f"checkpoint's --arch (an architecture of the {trained['encoding']} encoding, or --positional-encoding "
            f"{trained['encoding']}), {way_out}")
    earlier = trained["options"]
    differing = []
    for dest, value in sorted(earlier.items()):
        ours = options.get(dest)
        if ours is None or _same(ours.value, value):
            continue
        followed_changed = any(other in options and other in earlier and not _same(options[other].value, earlier[other])
                               for other in ours.follows)
        if not (ours.given or followed_changed):
            differing.append((dest, ours.value, value))
    if not differing:
        return
    it = "it" if len(differing) == 1 else "them"
    ours_shown = ", ".join(shown(dest, value) for dest, value, _ in differing)
    theirs_shown = " ".join(shown(dest, value) for dest, _, value in differing)
    # (a flag, or an option unset by default, cannot be given as absent)
    change = "" if all(isinstance(value, bool) or value is None for _, value, _ in differing) else \
        f", another value to change {it}"
    overrides = ", ".join(f"'{dest}': {value!r}" for dest, _, value in differing)
    raise OptionValueError(
        f"{ours_shown} ({'the default' if it == 'it' else 'the defaults'}): the checkpoint's weights were trained "
        f"with {theirs_shown}; give {theirs_shown} to keep {it}{change}, {way_out} (when loading a stored "
        f"checkpoint: --model-overrides \"{{{overrides}}}\")")
