"""Positional encodings, one module each (FLOATER a package); importing this package registers all of them."""
import importlib
import pkgutil

from .base import ENCODINGS, ModelDims, PositionalEncoding, build_encoding, register_encoding

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ENCODINGS", "ModelDims", "PositionalEncoding", "build_encoding", "register_encoding"]
