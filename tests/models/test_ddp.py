"""PyTorch DDP as fairseq's c10d / pytorch_ddp backend wraps the model (its default on GPUs), with and
without --checkpoint-activations / --offload-activations: the same gradients as the plain model, for
every encoding, including the terms shared by several layers (XL/GCDF's u and v, FLOATER's dynamics and
b(0), a T5/AT5 table shared by all layers), which DDP lets reach their parameter once per backward.
Two steps each: DDP reports a parameter whose gradient it did not reduce (none reached it, or the
backward ended before its bucket did) only at the next forward.

fairseq's own wrapper (distributed_fairseq_model) passes `device_ids=[device]`, which DDP refuses for a
CPU module; the wrapping here is the same call without it on the CPU (one gloo process), with it on
CUDA (--device cuda: one NCCL process, as fairseq trains on GPUs)."""
import socket

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from posenc_fairseq.encodings import ENCODINGS
from test_checkpoint_activations import assert_same_gradients, gradients_of_steps

SHARED = ["--scalar-bias-layers", "all", "--scalar-bias-share-layers"]
CASES = ([(name, []) for name in sorted(ENCODINGS)]
         + [("t5", SHARED), ("at5", SHARED), ("t5", ["--scalar-bias-layers", "all"]),
            ("floater", ["--floater-recompute-every", "3"])])
FLAGS = [[], ["--checkpoint-activations"], ["--offload-activations"]]


@pytest.fixture(scope="module")
def process_group(device):
    """One process: gloo on the CPU, NCCL on CUDA (fairseq's backends for each)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fairseq_c10d(model):
    """fairseq's DistributedDataParallel call for --ddp-backend c10d/pytorch_ddp, its defaults
    (broadcast_buffers, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view); its device
    (device_ids, output_device) on CUDA only."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    return DistributedDataParallel(model, device_ids=[device.index] if cuda else None,
                                   output_device=device.index if cuda else None, broadcast_buffers=False,
                                   bucket_cap_mb=25, find_unused_parameters=False, gradient_as_bucket_view=False)


@pytest.mark.parametrize("encoding,extra", CASES, ids=[f"{n}{'-' + '-'.join(e).replace('--', '') if e else ''}"
                                                       for n, e in CASES])
def test_ddp_gives_the_plain_gradients(translation_data, device, process_group, encoding, extra):
    """Each of FLAGS (plain, --checkpoint-activations, --offload-activations) under DDP against the
    plain model's gradients of the same two steps (computed once per case), on the device."""
    plain_model, plain = gradients_of_steps(translation_data, encoding, extra, device=device)
    state = {k: v for k, v in plain_model.state_dict().items() if "window_" not in k}
    for flag in FLAGS:
        _, wrapped = gradients_of_steps(translation_data, encoding, [*extra, *flag], state, wrap=fairseq_c10d,
                                        device=device)
        assert len(wrapped) == len(plain) == 2
        for step, (got, expected) in enumerate(zip(wrapped, plain), start=1):
            assert_same_gradients(got, expected, (encoding, extra, flag, f"step {step}"))


def test_an_unreduced_gradient_shows_at_the_second_step(translation_data, device, process_group):
    """Why two steps: a parameter no gradient reaches passes one DDP step silently; the next forward
    raises."""
    def with_an_unused_parameter(model):
        model.register_parameter("unused", torch.nn.Parameter(torch.zeros(1, device=device)))
        return fairseq_c10d(model)

    gradients_of_steps(translation_data, "t5", [], wrap=with_an_unused_parameter, steps=1, device=device)
    with pytest.raises(RuntimeError, match="finished reduction in the prior iteration"):
        gradients_of_steps(translation_data, "t5", [], wrap=with_an_unused_parameter, steps=2, device=device)


def test_the_reentrant_wrapper_is_not_used(translation_data):
    """What made DDP fail: fairseq's reentrant checkpoint accumulates a shared parameter's gradient
    once per layer. Our stacks checkpoint non-reentrantly, and fairseq can still unwrap them."""
    from fairseq.modules.checkpoint_activations import unwrap_checkpoint
    from util import TINY_TRANSFORMER, build_model

    model, _, _ = build_model(translation_data, "transformer_xl", [*TINY_TRANSFORMER, "--checkpoint-activations"])
    layers = [*model.encoder.layers, *model.decoder.layers]
    assert all(layer.forward.func.__module__ == "posenc_fairseq.layer_checkpoint" for layer in layers)
    unwrap_checkpoint(model)
    assert not any(hasattr(layer, "precheckpoint_forward") for layer in layers)


@pytest.mark.parametrize("arch", ["transformer_t5", "transformer_floater"])
def test_fully_sharded_is_refused_in_one_line(translation_data, arch):
    """FSDP flattens the shared encoding's parameters: refused when fairseq builds the model, naming
    what works instead."""
    from util import TINY_TRANSFORMER, build_model

    with pytest.raises(ValueError, match=r"fully_sharded.*--ddp-backend pytorch_ddp .*--checkpoint-activations") as error:
        build_model(translation_data, arch, [*TINY_TRANSFORMER, "--ddp-backend", "fully_sharded"])
    assert "\n" not in str(error.value)
