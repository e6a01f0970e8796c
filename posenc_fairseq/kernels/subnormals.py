"""CPU: the backward of attention with wide-range position terms runs with subnormals flushed to zero."""
import torch
from torch import Tensor


def _flushing_subnormals() -> bool:
    """Whether this thread already flushes subnormal floats to zero (PyTorch has a setter only)."""
    return (torch.tensor(1e-39) * 2).item() == 0.0


def flush_subnormals_in_backward(last: Tensor, first: Tensor) -> None:
    """CPU: flush subnormal floats to zero while autograd runs the backward of one attention,
    from `last` (its output) down to `first` (q.k), unless the thread already does.

    Why: position terms of wide range (ALiBi's slope times distance, T5's far buckets, XL's
    relative logits) put many probabilities at exp(-87..-103), the subnormal range, and CPU
    arithmetic on subnormals is far slower (docs/benchmarks.md). What is flushed is below 1.2e-38,
    far below what fp32 resolves in the sums it enters (the probabilities sum to 1). The thread's
    setting is restored at `first`, and at the end of the backward pass whatever happens in between."""
    if torch.compiler.is_compiling() or last.grad_fn is None or first.grad_fn is None or last.device.type != "cpu":
        return
    state = {}

    def stop(*_):
        if state.pop("set", False):
            torch.set_flush_denormal(False)

    def start(_):
        if "set" not in state and not _flushing_subnormals():
            state["set"] = torch.set_flush_denormal(True)
            torch.autograd.Variable._execution_engine.queue_callback(stop)

    last.grad_fn.register_prehook(start)
    first.grad_fn.register_hook(stop)
