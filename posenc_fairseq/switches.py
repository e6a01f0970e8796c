"""The environment variables that switch one of the plugin's paths: read when used, never cached,
each defined (name, choices, default) by the module it switches."""
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
