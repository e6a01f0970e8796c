"""The environment variables that switch one of the plugin's paths: read when used, never cached,
each defined (name, choices, default) by the module it switches, except the two attention paths'
switches below: a stack reads them when it starts a pass (encodings/base.py), and the encodings do
not import the kernels."""
import os


def choice(variable: str, choices: tuple, default: str) -> str:
    """`variable`'s value now, `default` where unset; a value not among `choices` is refused."""
    value = os.environ.get(variable, default)
    if value not in choices:
        raise ValueError(f"{variable}={value!r}: expected one of {', '.join(choices)}")
    return value


def count(variable: str, default: int) -> int:
    """`variable`'s value now as a whole number >= 0, `default` where unset; anything else is refused."""
    value = os.environ.get(variable)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise ValueError(f"{variable}={value!r}: expected a whole number >= 0")
    return int(value)


#: the variable that selects where FlexAttention serves (kernels/flex.py), and its values
FLEX_ATTENTION = "POSENC_FLEX_ATTENTION"
FLEX_ATTENTION_MODES = ("off", "on", "train")
#: the variable that selects the Triton kernel (kernels/triton_attention.py), and its values
TRITON_ATTENTION = "POSENC_TRITON_ATTENTION"
TRITON_ATTENTION_MODES = ("auto", "off", "on")
#: `triton_attention_mode()` where the switch is on and Triton runs kernels in its CPU interpreter: CPU tensors too
INTERPRETED = "interpreted"


def flex_attention_mode() -> str:
    """POSENC_FLEX_ATTENTION now ("off" where unset); an unknown value is refused."""
    return choice(FLEX_ATTENTION, FLEX_ATTENTION_MODES, "off")


def triton_attention_mode() -> str:
    """POSENC_TRITON_ATTENTION now ("auto" where unset; "interpreted" for "on" under Triton's
    interpreter); an unknown value is refused."""
    value = choice(TRITON_ATTENTION, TRITON_ATTENTION_MODES, "auto")
    return INTERPRETED if value == "on" and triton_interpreted() else value


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
