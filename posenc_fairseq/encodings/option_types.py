"""Checked option values, shared by every encoding and the conversion scripts.

Two uses of the same checkers, so a value is judged the same wherever it comes from:

- as argparse `type=` (fairseq's legacy `add_args`): a bad value ends in fairseq's usual
  `error: argument --shaw-k: invalid value '0': expected an integer in [1, 65536]` and exit 2;
- when an encoding is built from a Namespace (a checkpoint's stored config, the converters'
  overrides, code that builds models directly): `option(args, "shaw_k", positive_int, 16)` reads,
  checks and returns the value, raising `OptionValueError` (a ValueError) with one line
  `--shaw-k 0: expected an integer in [1, 65536]`.

`option` uses the default only when the option is absent or None, never for a falsy value:
0 is honoured where it is allowed and refused where it is not (never `value or DEFAULT`).
`check_size` refuses allocations beyond a limit with the computed figure.
"""
import argparse
import math
from typing import Any, Callable, Optional, Sequence

#: parameters one option may make an encoding allocate (refused above, with the figure)
MAX_PARAMETER_BYTES = 2 ** 30


try:  # fairseq-hydra-train: hydra prints its compact exceptions as their message alone, others as a traceback
    from hydra.errors import CompactHydraException as _OneLineUnderHydra
except ImportError:  # (fairseq needs hydra; this module alone does not)
    class _OneLineUnderHydra(Exception):
        pass


class OptionValueError(ValueError, _OneLineUnderHydra):
    """An option's value is outside its allowed range; the message names option, value and range.
    (fairseq's other commands print it in one line through compat/option_errors.py.)"""


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


class Checker:
    """Parses and checks one value: an int or float in a range (bounds optional, open or closed),
    optionally even. Accepts command-line strings and already-typed values (ints for int
    options, ints or floats for float options; bools are refused for both). Returns the value
    as int/float or raises argparse.ArgumentTypeError naming the allowed range."""

    def __init__(self, kind: type, low=None, high=None, low_open: bool = False, high_open: bool = False,
                 even: bool = False, name: Optional[str] = None):
        if kind not in (int, float):
            raise TypeError("Checker kind must be int or float")
        self.kind, self.low, self.high = kind, low, high
        self.low_open, self.high_open, self.even = low_open, high_open, even
        self.__name__ = name or self.describe()  # argparse uses type.__name__ in some messages

    def describe(self) -> str:
        what = ("an even integer" if self.even else "an integer") if self.kind is int else "a finite number"
        low, high = self.low, self.high
        if low is not None and high is not None:
            return f"{what} in {'(' if self.low_open else '['}{_number(low)}, {_number(high)}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{what} {'>' if self.low_open else '>='} {_number(low)}"
        if high is not None:
            return f"{what} {'<' if self.high_open else '<='} {_number(high)}"
        return what

    def __repr__(self):
        return f"<option type: {self.describe()}>"

    def _fail(self, value):
        shown = value if isinstance(value, str) else _number(value) if isinstance(value, (int, float)) else repr(value)
        raise argparse.ArgumentTypeError(f"invalid value {shown!r}: expected {self.describe()}")

    def _parse(self, value):
        if isinstance(value, bool):
            self._fail(value)
        if self.kind is int:
            if isinstance(value, int):
                return value
            if isinstance(value, float):
                return int(value) if value.is_integer() else self._fail(value)
            if isinstance(value, str):
                try:
                    return int(value.strip())
                except ValueError:
                    self._fail(value)
            self._fail(value)
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                self._fail(value)
        else:
            self._fail(value)
        if not math.isfinite(number):
            self._fail(value)
        return number

    def __call__(self, value):
        number = self._parse(value)
        if self.low is not None and (number < self.low or (self.low_open and number == self.low)):
            self._fail(value)
        if self.high is not None and (number > self.high or (self.high_open and number == self.high)):
            self._fail(value)
        if self.even and number % 2:
            self._fail(value)
        return number


def int_in_range(low: Optional[int] = None, high: Optional[int] = None) -> Checker:
    """An integer with low <= value <= high (either bound may be None)."""
    return Checker(int, low, high)


def float_in_range(low: Optional[float] = None, high: Optional[float] = None,
                   low_open: bool = False, high_open: bool = False) -> Checker:
    """A finite float between low and high (closed bounds unless *_open)."""
    return Checker(float, low, high, low_open=low_open, high_open=high_open)


def even_int_in_range(low: Optional[int] = None, high: Optional[int] = None) -> Checker:
    return Checker(int, low, high, even=True)


finite_float = Checker(float, name="finite_float")
positive_float = Checker(float, 0.0, low_open=True, name="positive_float")
nonnegative_float = Checker(float, 0.0, name="nonnegative_float")
positive_int = Checker(int, 1, name="positive_int")
nonnegative_int = Checker(int, 0, name="nonnegative_int")
even_positive_int = Checker(int, 2, even=True, name="even_positive_int")
#: a dropout probability, 0 <= p < 1
probability = Checker(float, 0.0, 1.0, high_open=True, name="probability")


class one_of:
    """A string among `choices` (for re-checking values that argparse's `choices=` checked on the
    command line but a Namespace may hold unchecked)."""

    def __init__(self, *choices: str):
        self.choices = tuple(choices)
        self.__name__ = "one_of"

    def describe(self) -> str:
        return "one of " + ", ".join(self.choices)

    def __call__(self, value):
        if not isinstance(value, str) or value not in self.choices:
            raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected {self.describe()}")
        return value


def flag(value) -> bool:
    """An on/off option: a bool, or one of on/off, true/false, yes/no, 1/0 (any case; e.g. a
    --model-overrides string); anything else is refused rather than read by truthiness ('false'
    is not True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, int)):
        text = str(value).strip().lower()
        if text in ("on", "true", "yes", "1"):
            return True
        if text in ("off", "false", "no", "0"):
            return False
    raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected on/off (true/false)")


flag.__name__ = "on/off"


def flag_name(dest: str) -> str:
    """'shaw_k' -> '--shaw-k'."""
    return "--" + dest.replace("_", "-")


def checked(dest: str, value, checker: Callable[[Any], Any]):
    """`checker(value)`, with a failure turned into OptionValueError naming the option."""
    try:
        return checker(value)
    except argparse.ArgumentTypeError as error:
        message = str(error)
        if message.startswith("invalid value "):  # "--shaw-k 0: expected ..." reads better here
            shown = value if isinstance(value, str) else _number(value) if isinstance(value, (int, float)) else repr(value)
            message = f"{shown}: " + message.split(": ", 1)[1]
            raise OptionValueError(f"{flag_name(dest)} {message}") from None
        raise OptionValueError(f"{flag_name(dest)}: {message}") from None


def given(args, dest: str):
    """The value of option `dest` in Namespace (or dict-like config) `args` as given, unchecked; None
    where it was not (the option's default applies)."""
    return args.get(dest) if isinstance(args, dict) else getattr(args, dest, None)


def option(args, dest: str, checker: Callable[[Any], Any], default):
    """The value of option `dest` in Namespace (or dict-like config) `args`, checked; `default`
    (not checked) only when it is absent or None, so a given 0 is judged, never replaced."""
    value = given(args, dest)
    if value is None:
        return default
    return checked(dest, value, checker)


def option_pair(args, dest: str, checker: Callable[[Any], Any], default: Sequence, ordered: bool = False):
    """A two-value option (argparse nargs=2), each value checked; with `ordered`, first <= second."""
    value = given(args, dest)
    if value is None:
        return tuple(default)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise OptionValueError(f"{flag_name(dest)} {value!r}: expected two values")
    first, second = (checked(dest, item, checker) for item in value)
    if ordered and first > second:
        raise OptionValueError(f"{flag_name(dest)} {_number(first)} {_number(second)}: "
                               "expected MIN <= MAX (the first value must not exceed the second)")
    return first, second


def ordered_pair(checker: Callable[[Any], Any], positive_max: bool = False):
    """argparse action for `nargs=2` options whose two values must satisfy first <= second (and,
    with `positive_max`, second > 0); each value is checked by `type=checker` first."""

    class OrderedPair(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            first, second = values
            if first > second or (positive_max and second <= 0):
                wanted = "MIN <= MAX and MAX > 0" if positive_max else "MIN <= MAX"
                raise argparse.ArgumentError(
                    self, f"invalid values {_number(first)} {_number(second)}: expected {wanted}")
            setattr(namespace, self.dest, [first, second])

    return OrderedPair


def format_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if count < 1024 or unit == "PiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} PiB"  # pragma: no cover


def check_size(option_text: str, elements: int, what: str, bytes_per_element: int = 4,
               limit: int = MAX_PARAMETER_BYTES):
    """Refuse (OptionValueError) when `option_text` (e.g. '--shaw-k 1000000000') would make the
    encoding allocate `elements` values of `what` beyond `limit` bytes, with the computed figure."""
    size = int(elements) * bytes_per_element
    if size > limit:
        raise OptionValueError(f"{option_text}: {what} would take {format_bytes(size)} "
                               f"({int(elements):,} values); the limit is {format_bytes(limit)}")
