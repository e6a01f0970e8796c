"""Positional encodings, one module each (FLOATER a package); importing this package registers all of them."""
import importlib
import pkgutil

from .base import ENCODINGS, ModelDims, PositionalEncoding, build_encoding, options_of, register_encoding
from .option_types import flag_name, given

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")


def options_of_other_encodings(name: str, values) -> dict:
    """{--option: [the encodings that read it]} of the options in `values` (a dict by dest, or a model's
    args: Namespace or hydra's config) that encoding `name` does not read, set to something else than
    absent or default: e.g. --floater-method given to a t5 model, which it would not change."""
    own, found = options_of(name), {}
    for other in sorted(ENCODINGS):
        for dest, default in options_of(other).items():
            if dest not in own and given(values, dest) not in (None, default):
                found.setdefault(flag_name(dest), []).append(other)
    return found


__all__ = ["ENCODINGS", "ModelDims", "PositionalEncoding", "build_encoding", "options_of",
           "options_of_other_encodings", "register_encoding"]
