"""What an encoding's weights were trained with, kept in their state dict and checked on a strict load.

fairseq-train builds the model for --restore-file from its command line, not from the checkpoint's
config. An encoding option left out there (--t5-max-distance, --gcdf-lambda, --rotary-base ...), or
another parameter-free encoding (alibi weights under a rotary architecture), would give the weights
another encoding than the one they were trained with wherever the parameter shapes agree, silently.
So every encoding saves under `{prefix}trained_with` its name and the values of the options that
define what it computes (`PositionalEncoding.defining_option`), and a strict load refuses, in one
line, weights trained with another encoding, or with another value of an option that the model has
only by default. A value given (command line, --model-overrides) is taken as meant. Options of
training alone (FLOATER's recompute interval, initialisations, dropout) are not kept. Checkpoints
without the entry (stock fairseq's, older ones) load as before.

The entry is a float tensor of the UTF-8 bytes of a JSON object: fairseq's checkpoint averaging and
EMA treat every state-dict entry as a floating tensor (EMA multiplies each by its decay); equal entries
average to themselves, to within rounding, and are read back rounded.
"""
import json
from typing import Dict, NamedTuple

import torch
from torch import Tensor

from .option_types import OptionValueError, flag_name, shown_number

#: the state-dict key of the entry, under the encoding's prefix
KEY = "trained_with"


class DefiningOption(NamedTuple):
    """An option that defines what an encoding computes, as the encoding read it."""
    value: object  # the value used (a number, string, bool, pair or None)
    given: bool  # whether the model's config gave it (else the option's default)


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


def shown(dest: str, value) -> str:
    """The command-line form of option `dest` at `value` ('--t5-max-distance 64', '--floater-autonomous',
    'no --floater-stop-position')."""
    if value is True:
        return flag_name(dest)
    if value is False or value is None:
        return f"no {flag_name(dest)}"
    values = value if isinstance(value, (list, tuple)) else [value]
    return " ".join([flag_name(dest), *(shown_number(item) for item in values)])


def check(saved, name: str, options: Dict[str, DefiningOption]) -> None:
    """Refuse (OptionValueError, one line) the saved entry of weights trained with another encoding
    than `name`, or with another value of an option that `options` hold by default."""
    trained = read(saved)
    if trained["encoding"] != name:
        raise OptionValueError(
            f"the checkpoint's weights were trained with the {trained['encoding']} encoding, not {name}: give the "
            f"checkpoint's --arch (an architecture of the {trained['encoding']} encoding)")
    for dest, value in sorted(trained["options"].items()):
        ours = options.get(dest)
        if ours is None or ours.given or json.loads(json.dumps(ours.value)) == value:
            continue
        fixed = isinstance(ours.value, bool) or ours.value is None  # (a flag cannot be given as absent)
        change = "" if fixed else f", or {shown(dest, ours.value)} to change it"
        raise OptionValueError(
            f"{shown(dest, ours.value)} (the default): the checkpoint's weights were trained with "
            f"{shown(dest, value)}; give {shown(dest, value)} to keep it{change} (a stored checkpoint: "
            f"--model-overrides \"{{'{dest}': {value!r}}}\")")
