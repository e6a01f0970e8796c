"""fairseq's --checkpoint-activations / --offload-activations for the posenc stacks, non-reentrant.

fairseq's own `checkpoint_wrapper` is reentrant: during backward it recomputes each layer and runs a
separate `torch.autograd.backward` through it. A parameter that several layers use (XL/GCDF's u and
v, FLOATER's dynamics and b(0), a T5/AT5 table shared by the layers) then has its gradient
accumulated once per layer, which DDP refuses ("Expected to mark a variable ready only once").
Here each layer runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`: its saved
tensors are dropped and recomputed, but the gradient flows through the one autograd graph of the
forward pass, so every parameter is reached once, as without checkpointing.

A recomputation must repeat the forward's operations exactly. Terms the encoding shares across layers
are computed in the first layer that asks for them and found memoized by the others
(`PositionalEncoding.memoize`); `PositionalEncoding.recorded` makes the recomputation repeat those
hits and misses. (FLOATER computes its biases before the layers run: `Floater.begin`.)

`--offload-activations`: the layer's inputs, which the checkpoint keeps for the recomputation, are
kept in CPU memory and copied back to the device when the layer runs (fairseq's meaning of the flag).
"""
import functools

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint


def checkpoint_layer(layer: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """Make `layer`'s forward run checkpointed when a gradient is needed. As fairseq's
    `checkpoint_wrapper`, the original forward stays as `layer.precheckpoint_forward` (fairseq's
    `unwrap_checkpoint` restores it) and the parameters keep their names."""
    layer.precheckpoint_forward = layer.forward
    layer.forward = functools.partial(_checkpointed_forward, layer.precheckpoint_forward, offload)
    return layer


def bound_encoding(layer: torch.nn.Module):
    """The positional encoding the layer's attention is bound to (None: not bound)."""
    binding = getattr(getattr(layer, "self_attn", None), "position_binding", None)
    return binding.encoding if binding is not None else None


def _checkpointed_forward(forward, offload: bool, *args, **kwargs):
    if not torch.is_grad_enabled():  # inference, validation: nothing to save
        return forward(*args, **kwargs)
    encoding = bound_encoding(forward.__self__)
    function = encoding.recorded(forward) if encoding is not None else forward
    if offload:
        args, kwargs, function = _offloaded(args, kwargs, function)
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _offloaded(args, kwargs, function):
    """CPU copies of the device tensors among the inputs, and `function` that moves them back."""
    devices = {}

    def to_cpu(value):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            moved = value.to("cpu")
            devices[id(moved)] = value.device
            return moved
        return value

    args, kwargs = pytree.tree_map(to_cpu, (args, kwargs))

    def on_device(*inner_args, **inner_kwargs):
        back = pytree.tree_map(
            lambda value: value.to(devices[id(value)]) if isinstance(value, torch.Tensor) and id(value) in devices
            else value, (inner_args, inner_kwargs))
        return function(*back[0], **back[1])

    return args, kwargs, on_device
