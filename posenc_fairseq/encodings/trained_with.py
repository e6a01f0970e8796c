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

The entry is a float tensor of the UTF-8 bytes of a JSON object and of its digest: fairseq's EMA
multiplies every state-dict entry by its decay in place (an integer tensor would fail), and checkpoint
averaging adds them up. Equal entries average to themselves (EMA's to within rounding: read back
rounded to the nearest byte, since --ema-fp32's one copy drifts by an ulp of each step, past a tight
tolerance in a long run at fairseq's default decay); the average of two different ones fails its digest,
where its bytes alone might read as a third entry (the options 500 and 700 averaged to 600).
"""
import hashlib
import json
from typing import Dict, List, NamedTuple, Tuple

import torch
from torch import Tensor

from .option_types import OptionValueError, flag_name

#: the state-dict key of the entry, under the encoding's prefix
KEY = "trained_with"
DIGEST_BYTES = 8


class DefiningOption(NamedTuple):
    """An option that defines what an encoding computes, as the encoding read it."""
    value: object  # the value computed with (a number, string, bool, pair or None)
    given: bool  # whether the model's config gave it (else the option's default)
    follows: Tuple[str, ...] = ()  # the options a computed default follows (given with another value: so is this)


def entry(name: str, options: Dict[str, DefiningOption]) -> Tensor:
    """The state-dict entry of encoding `name` built with `options`."""
    text = json.dumps({"encoding": name, "options": {dest: option.value for dest, option in options.items()}},
                      sort_keys=True).encode()
    return torch.tensor(list(text + _digest(text)), dtype=torch.float32)


def _digest(text: bytes) -> bytes:
    return hashlib.sha256(text).digest()[:DIGEST_BYTES]


def read(saved) -> dict:
    """{"encoding": name, "options": {dest: value}} from a saved entry; OptionValueError where it is
    not one (the average of checkpoints of differently built models, say)."""
    try:
        codes = torch.as_tensor(saved).detach().double()
        rounded = codes.round()  # (EMA's x * d + x * (1 - d) is x to within rounding; the digest tells the rest)
        if codes.dim() != 1 or not bool(((rounded >= 0) & (rounded <= 255) & ((codes - rounded).abs() < 0.5)).all()):
            raise ValueError("not byte values")
        data = bytes(rounded.to(torch.uint8).tolist())
        text, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if _digest(text) != digest:
            raise ValueError("its digest differs")
        trained = json.loads(text.decode())
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


def check(saved, name: str, options: Dict[str, DefiningOption], loadable: bool = True) -> None:
    """Refuse (OptionValueError, one line) the saved entry of weights trained with another encoding
    than `name`, or with other values of options that `options` hold by default (all of them named).
    `loadable`: whether the weights fit this model's by name and shape, so that --allow-encoding-change
    (and another value of an option) can load them."""
    trained = read(saved)
    if trained["encoding"] != name:
        way_out = f", {WAY_OUT}" if loadable else f" ({NO_WAY_OUT})"
        raise OptionValueError(
            f"the checkpoint's weights were trained with the {trained['encoding']} encoding, not {name}: give the "
            f"checkpoint's --arch (an architecture of the {trained['encoding']} encoding, or --positional-encoding "
            f"{trained['encoding']}){way_out}")
    found = differing(trained["options"], options)
    if found:
        raise OptionValueError(refusal(found, loadable))


WAY_OUT = "or --allow-encoding-change to load the weights as they are"
NO_WAY_OUT = "the encoding's weights differ from this model's in shape: --allow-encoding-change cannot load them"


def described(saved) -> str:
    """What a saved entry says the weights were trained with: 't5 with --t5-num-buckets 16 ...'."""
    trained = read(saved)
    options = " ".join(shown(dest, value) for dest, value in sorted(trained["options"].items())
                       if value is not None and value is not False)
    return f"{trained['encoding']}{' with ' + options if options else ''}"


def differing(trained: dict, options: Dict[str, DefiningOption]) -> List[Tuple[str, object, object]]:
    """(dest, our value, the trained value) of each option `trained` ({dest: value}) has another value of
    than `options` hold by default: not given, and not following an option given another value."""
    found = []
    for dest, theirs in sorted(trained.items()):
        ours = options.get(dest)
        if ours is None or ours.given or _same(ours.value, theirs):
            continue
        if not any(other in options and other in trained and not _same(options[other].value, trained[other])
                   for other in ours.follows):
            found.append((dest, ours.value, theirs))
    return found


def refusal(found: List[Tuple[str, object, object]], loadable: bool = True) -> str:
    """The one line that names the `differing` options and the ways out (`loadable`: the weights fit
    this model's shapes, so another value or --allow-encoding-change can load them)."""
    it = "it" if len(found) == 1 else "them"
    ours_shown = ", ".join(shown(dest, ours) for dest, ours, _ in found)
    theirs_shown = " ".join(shown(dest, theirs) for dest, _, theirs in found)
    # (a flag cannot be given as absent)
    change = "" if all(isinstance(ours, bool) for _, ours, _ in found) else f", another value to change {it}"
    overrides = ", ".join(f"'{dest}': {theirs!r}" for dest, _, theirs in found)
    ways_out = f"to keep {it}{change}, {WAY_OUT}" if loadable else f"({NO_WAY_OUT})"
    return (f"{ours_shown} ({'the default' if it == 'it' else 'the defaults'}): the checkpoint's weights were "
            f"trained with {theirs_shown}; give {theirs_shown} {ways_out} (when loading a "
            f"stored checkpoint: --model-overrides \"{{{overrides}}}\")")
