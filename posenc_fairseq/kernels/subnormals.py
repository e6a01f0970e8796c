"""CPU: the backward of attention with wide-range position terms runs with subnormals flushed to zero."""
import threading
import weakref

import torch
from torch import Tensor


def _flushing_subnormals() -> bool:
    """Whether this thread already flushes subnormal floats to zero (PyTorch has a setter only)."""
    return (torch.tensor(1e-39) * 2).item() == 0.0


class _Switched:
    """One attention's backward that switched flushing on: on which thread, in which backward pass
    (autograd's graph task), and whether it is still on."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.graph_task = torch._C._current_graph_task_id()
        self.on = torch.set_flush_denormal(True)

    def off(self) -> None:
        # the setting is the thread's: only the thread that switched it on can switch it off
        if self.on and threading.get_ident() == self.thread:
            self.on = False
            torch.set_flush_denormal(False)


class _Thread(threading.local):
    #: the backward that switched flushing on in this thread and has not switched it off
    switched = None


_this_thread = _Thread()


def _switch_off_left_over() -> None:
    """A backward that raised midway runs neither its last hook nor its end-of-pass callback: put
    the thread back once that pass is over (at the next attention's forward on the thread), unless
    this forward runs inside that same pass (activation checkpointing's recomputation)."""
    switched = _this_thread.switched
    if switched is not None and switched.graph_task != torch._C._current_graph_task_id():
        switched.off()
        _this_thread.switched = None


def flush_subnormals_in_backward(last: Tensor, first: Tensor) -> None:
    """CPU: flush subnormal floats to zero while autograd runs the backward of one attention,
    from `last` (its output) down to `first` (q.k), unless the thread already does.

    Why: position terms of wide range (ALiBi's slope times distance, T5's far buckets, XL's
    relative logits) put many probabilities at exp(-87..-103), the subnormal range, and CPU
    arithmetic on subnormals is far slower (docs/benchmarks.md). What is flushed is below 1.2e-38,
    far below what fp32 resolves in the sums it enters (the probabilities sum to 1). The thread's
    setting is restored at `first`, and at the end of the backward pass whatever happens in between.
    A backward that raises in between ends neither way: the setting is restored when its graph is
    freed, or at the next attention's forward on the thread, whichever comes first."""
    if torch.compiler.is_compiling() or last.grad_fn is None or first.grad_fn is None or last.device.type != "cpu":
        return
    _switch_off_left_over()
    state = {}

    def stop(*_):
        switched = state.pop("switched", None)
        if switched is not None:
            switched.off()
            if _this_thread.switched is switched:
                _this_thread.switched = None

    def start(_):
        if "switched" not in state and not _flushing_subnormals():
            state["switched"] = _this_thread.switched = switched = _Switched()
            torch.autograd.Variable._execution_engine.queue_callback(stop)
            # the graph holds `stop` (first's hook): freeing the graph after a failed backward frees it
            weakref.finalize(stop, switched.off)

    last.grad_fn.register_prehook(start)
    first.grad_fn.register_hook(stop)
