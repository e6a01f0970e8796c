"""Make fairseq checkpoints load under torch >= 2.6, whose `torch.load` defaults to `weights_only=True`.

fairseq-fixed 0.12.3.1 calls `torch.load` without `weights_only`, and pickles its config into every
checkpoint: argparse.Namespace, omegaconf containers, numpy scalars/arrays (e.g. with --eval-bleu)
and, for distributed resume, a placeholder class. torch's safe loading refuses them ("Unsupported
global"), for stock models' checkpoints as much as for ours. We allow-list exactly those types,
which keeps torch's safe loading for everything else (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 would also
work but disables the check for every load). The allow-list is the process's, and every model's
checkpoint holds the same config, so every model needs it; the types are plain data, not code.
fairseq imports the --user-dir before it loads any checkpoint (train, generate, interactive, every
distributed rank, from_pretrained(user_dir=...)), so importing the plugin suffices.
"""
import argparse
import collections
import io
import pickle
import typing
import warnings

import numpy
import torch


def checkpoint_globals() -> list:
    """The types fairseq pickles into its checkpoints (those of numpy 1 and 2 both)."""
    import omegaconf
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    found = [
        argparse.Namespace,
        collections.defaultdict,
        collections.OrderedDict,
        dict, list, int, float, str, bool, tuple, set,
        typing.Any,
        omegaconf.DictConfig, omegaconf.ListConfig, ContainerMetadata, Metadata, AnyNode,
        omegaconf.nodes.StringNode, omegaconf.nodes.IntegerNode, omegaconf.nodes.FloatNode,
        omegaconf.nodes.BooleanNode, omegaconf.nodes.EnumNode,
        numpy.ndarray, numpy.dtype,
    ]
    # numpy 2 moved numpy.core to numpy._core; checkpoints written under numpy 1 name the old path
    multiarray = (numpy._core if hasattr(numpy, "_core") else numpy.core).multiarray
    for name in ("_reconstruct", "scalar"):
        found += [getattr(multiarray, name), (getattr(multiarray, name), f"numpy.core.multiarray.{name}")]
    # numpy >= 1.25 pickles dtypes as instances of per-type classes (numpy.dtypes.Float64DType ...)
    if hasattr(numpy, "dtypes"):
        found += [getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType")]
    try:
        from fairseq.distributed.utils import _TensorPlaceholder
        found.append(_TensorPlaceholder)
    except ImportError:
        pass
    return [item for item in found if item is not None]


def refuses_fairseq_config() -> bool:
    """Whether `torch.load`, as fairseq calls it, refuses a checkpoint holding an argparse.Namespace."""
    buffer = io.BytesIO()
    torch.save({"args": argparse.Namespace(arch="transformer")}, buffer)
    buffer.seek(0)
    try:
        with warnings.catch_warnings():  # torch < 2.6 warns that weights_only will change
            warnings.simplefilter("ignore")
            torch.load(buffer)
    except pickle.UnpicklingError:
        return True
    return False


def written_by_torch_save(path) -> bool:
    """Whether the file at `path` begins as torch.save's files do: a zip archive ("PK"), or a pickle
    (protocol 2 or later, 0x80) in the legacy format of old released checkpoints. Tells a text file
    given as a checkpoint from one before torch.load answers it with an unrelated error (KeyError: 105
    for a file starting with 'i')."""
    with open(path, "rb") as handle:
        magic = handle.read(2)
    return magic == b"PK" or magic.startswith(b"\x80")


def apply():
    if not refuses_fairseq_config():
        return None
    torch.serialization.add_safe_globals(checkpoint_globals())
    return (f"torch {torch.__version__}'s torch.load (weights_only=True) refuses the argparse, omegaconf and numpy "
            "objects in fairseq checkpoints; exactly those types allow-listed")
