"""Make fairseq checkpoints load again under torch >= 2.6 (`torch.load(weights_only=True)`).

fairseq pickles its config into checkpoints: argparse.Namespace, omegaconf containers, numpy
scalars/arrays (e.g. with --eval-bleu) and, for distributed resume, a placeholder class. We
allow-list exactly those types, which keeps torch's safe loading for everything else (setting
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 would also work but disables the check for every load).
fairseq imports the --user-dir before it loads any checkpoint (train, generate, interactive,
every distributed rank, from_pretrained(user_dir=...)), so importing the plugin suffices.
"""
import argparse
import collections
import typing

import numpy
import torch


def checkpoint_globals() -> list:
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


def allow_fairseq_checkpoints():
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(checkpoint_globals())
