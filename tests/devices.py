"""One test suite for CPU and GPU (a pytest plugin, loaded by tests/conftest.py): the `--device` option,
the `device` fixture the tests that a GPU changes take their device from, the `device` marker those
tests get, and the one table of the bounds their comparisons allow on each device and dtype.

    pytest tests                                  # everything on the CPU, as always
    pytest tests -m device --device cuda -rA      # only the tests a GPU changes, on CUDA (make test-cuda)

POSENC_TEST_DEVICE=cuda does what --device cuda does. On CUDA each test runs its model there and compares
it with the same reference as on the CPU (a float64 copy on the CPU, fp32 on the same device, or the full
pass); only the bound may differ, and BOUNDS below is the one place it is chosen. A comparison without
a bound for the device is skipped there, with the reason: never passed unchecked."""
import os

import pytest
import torch

DEVICES = ("cpu", "cuda")
ENVIRONMENT = "POSENC_TEST_DEVICE"

# The Triton kernels (kernels/triton_kernels.py) run on the CPU in Triton's interpreter, which Triton
# reads when the kernels are first imported: set before any test imports them, where no GPU is
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--device", choices=DEVICES, default=os.environ.get(ENVIRONMENT, "cpu"),
                     help=f"where the tests marked `device` run their models (default: ${ENVIRONMENT} or cpu)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "device: takes its device from the `device` fixture (--device cpu|cuda, tests/devices.py): "
                   "`pytest -m device --device cuda` runs the tests a GPU changes, on the GPU; set by the "
                   "plugin for every test that uses the fixture")
    if config.getoption("device") == "cuda" and not torch.cuda.is_available():
        # a session of skips would look like a passed GPU run
        raise pytest.UsageError("--device cuda: torch sees no CUDA device")


def pytest_collection_modifyitems(config, items):
    """The marker follows the fixture (also one asked for through another fixture, e.g. DDP's process
    group): `-m device` selects exactly the tests whose device --device sets."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


def describe(name):
    """The device in words, for the report's header and the JUnit XML's properties."""
    if name != "cuda":
        return f"{name} (torch {torch.__version__})"
    properties = torch.cuda.get_device_properties(0)
    return (f"cuda: {torch.cuda.get_device_name(0)}, {properties.total_memory / 2 ** 30:.0f} GiB, compute capability "
            f"{properties.major}.{properties.minor} (torch {torch.__version__}, CUDA {torch.version.cuda})")


def pytest_report_header(config):
    return f"device (tests marked `device`): {describe(config.getoption('device'))}"


@pytest.fixture(scope="session")
def device(request, record_testsuite_property):
    """The device the tests a GPU changes run their models on: --device (default $POSENC_TEST_DEVICE or
    cpu). CUDA as cuda:0, with its index: DDP's device_ids need it."""
    name = request.config.getoption("device")
    record_testsuite_property("device", describe(name))  # in --junitxml's report (without xdist)
    return torch.device("cuda", 0) if name == "cuda" else torch.device(name)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

#: (comparison, device type, dtype) -> the largest difference allowed, in the comparison's own measure (each
#: test says which). The CPU's are the bounds these tests always had. The CUDA ones have not been measured
#: by this suite yet (it has not run on a GPU): where a comparison is the same on the CPU it keeps the CPU's
#: bound; otherwise it is scripts/gpu_check.py's limit for the same comparison, which every encoding met on
#: an H100 (docs/gpu_check.md, checks a, c, d, g), with the largest value measured there noted.
BOUNDS = {
    # decoder logits one token at a time against the full pass, max |difference| (the logits are O(1)).
    # CUDA: other kernels serve a step and the pass (gpu_check g: fp32 <= 2.4e-7, fp16 <= 5.3e-4, bf16
    # <= 4.7e-3 of the largest log-probability)
    ("steps vs pass", "cpu", F32): 1e-5,
    ("steps vs pass", "cuda", F32): 1e-4,
    ("steps vs pass", "cuda", F16): 1e-2,
    ("steps vs pass", "cuda", BF16): 5e-2,
    # the same sentence with and without padding after it, max |difference| of the features
    ("padding", "cpu", F32): 1e-5,
    ("padding", "cuda", F32): 1e-4,
    # an fp32 model on the device against its float64 copy on the CPU: the loss, relative (gpu_check a:
    # <= 1.1e-7 on CUDA), and the gradients as one vector, relative to its norm (gpu_check a: <= 6.8e-6
    # per tensor on CUDA)
    ("float64 loss", "cpu", F32): 1e-5,
    ("float64 loss", "cuda", F32): 1e-5,
    ("float64 gradients", "cpu", F32): 1e-4,
    ("float64 gradients", "cuda", F32): 1e-4,
    # half precision against fp32 on the same device, relative: the loss, and the encoding's gradients as
    # one vector. "autocast" is torch.autocast to the dtype (fairseq's --amp); the CPU suite checks bf16
    # autocast only. CUDA: gpu_check c's limits (loss <= 6.1e-5 fp16, 5.9e-4 bf16; gradients <= 3.1e-2
    # fp16, 6.7e-2 bf16, models and autocast, on its own batch)
    ("half loss", "cpu", F16): 2e-4,
    ("half loss", "cpu", BF16): 2e-3,
    ("autocast loss", "cpu", BF16): 2e-3,
    ("half gradients", "cpu", F16): 0.04,
    ("half gradients", "cpu", BF16): 0.15,
    ("autocast gradients", "cpu", BF16): 0.1,
    ("half loss", "cuda", F16): 2e-3,
    ("half loss", "cuda", BF16): 1e-2,
    ("autocast loss", "cuda", F16): 2e-3,
    ("autocast loss", "cuda", BF16): 1e-2,
    ("half gradients", "cuda", F16): 0.1,
    ("half gradients", "cuda", BF16): 0.2,
    ("autocast gradients", "cuda", F16): 0.1,
    ("autocast gradients", "cuda", BF16): 0.2,
    # a half-precision model's logits against fp32's, max |difference| relative to the largest fp32 logit
    # (below what losing the position term changes: each test checks that too)
    ("half logits", "cpu", F16): 0.003,
    ("half logits", "cpu", BF16): 0.02,
    ("half logits", "cuda", F16): 0.003,
    ("half logits", "cuda", BF16): 0.02,
    # the same model with --checkpoint-activations / --offload-activations and under DDP against the plain
    # one: each gradient, max |difference| / (1 + its largest entry) (gpu_check d: <= 2.8e-7 on CUDA)
    ("checkpointed vs plain", "cpu", F32): 1e-5,
    ("checkpointed vs plain", "cuda", F32): 1e-5,
    # FLOATER's table and its gradients as the device's solve runs against the Python loops on the device,
    # relative to the largest entry (on CUDA: the compiled CPU loops against the loops on the GPU)
    ("floater solve", "cpu", F32): 1e-5,
    ("floater solve", "cuda", F32): 1e-4,
    # the Triton kernel of a per-distance bias (kernels/triton_kernels.py) against the formula in float64,
    # output and each gradient, relative to its largest entry: the CPU runs it in Triton's interpreter
    # (numpy, float64 or float32); CUDA compiled, float32 inputs (not yet run on a GPU)
    ("triton vs formula", "cpu", torch.float64): 1e-12,
    ("triton vs formula", "cpu", F32): 1e-5,
    ("triton vs formula", "cuda", F32): 1e-4,
    # half precision (the interpreter's bfloat16 is wrong, numpy has none: CUDA only; its fp16 max 7e-4
    # relative for the gradients, 4e-3 for the output, on the interpreter)
    ("triton vs formula", "cpu", F16): 1e-2,
    ("triton vs formula", "cuda", F16): 1e-2,
    ("triton vs formula", "cuda", BF16): 5e-2,
    # a model's gradients with POSENC_TRITON_ATTENTION=on against the default paths, relative
    ("triton vs default paths", "cpu", F32): 1e-5,
    ("triton vs default paths", "cuda", F32): 1e-4,
}


def bound(device, comparison, dtype=F32):
    """The bound of `comparison` in `dtype` on `device` (BOUNDS); skips the test where there is none."""
    kind = torch.device(device).type
    if (comparison, kind, dtype) not in BOUNDS:
        pytest.skip(f"{comparison} in {str(dtype).removeprefix('torch.')} is not checked on {kind} "
                    f"(no bound in tests/devices.py)")
    return BOUNDS[comparison, kind, dtype]


def on(device, *tensors):
    """The tensors moved to `device` (a tuple, in order)."""
    return tuple(tensor.to(device) for tensor in tensors)


@pytest.fixture
def kernel_device(device):
    """Where a Triton kernel runs: --device cuda compiled, the CPU through Triton's interpreter."""
    pytest.importorskip("triton", reason="the kernels are written in Triton (installed by `make venv`)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA is present, so Triton's interpreter is off in this process: run with --device cuda")
    return device
