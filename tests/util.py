"""Helpers shared by the tests: tiny model options, running fairseq's commands, building models."""
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
USER_DIR = str(REPO / "posenc_fairseq")
BIN = Path(sys.executable).parent

TINY_TRANSFORMER = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
TINY_ROBERTA = [
    "--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4",
]
QUICK_TRAIN = [
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "2000", "--cpu",
    "--log-format", "simple", "--log-interval", "1", "--no-epoch-checkpoints", "--seed", "1",
    "--num-workers", "0",
]


#: what every command the tests run has in its environment: one thread (the workers share the cores;
#: MKL's too, as the demo and compare.py set it for their commands) and no warnings
COMMAND_VARIABLES = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def command_env(env=None):
    """The environment of a command the tests run: os.environ with COMMAND_VARIABLES, then `env`."""
    full = dict(os.environ, **COMMAND_VARIABLES)
    full.update(env or {})
    return full


def run(command, cwd=None, env=None, timeout=600):
    """Run a fairseq (or any) command; fail the test with its output if it fails."""
    command = [str(part) for part in command]
    if not os.path.isabs(command[0]) and (BIN / command[0]).exists():
        command[0] = str(BIN / command[0])
    done = subprocess.run(command, cwd=cwd, env=command_env(env), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    return done.stdout + done.stderr


def build_model(data_dir, arch, extra=(), task="translation"):
    """Build a model exactly as fairseq-train would, from command-line style options."""
    import posenc_fairseq  # noqa: F401
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, [str(data_dir), "--task", task, "--arch", arch, "--user-dir", USER_DIR, "--cpu", *extra])
    task_obj = tasks.setup_task(args)
    model = task_obj.build_model(args)
    return model, task_obj, args


def random_batch(dictionary, batch=3, src_len=7, tgt_len=6, seed=0, left_pad_source=True):
    """Source (left-padded, like fairseq's translation task) and target-prefix tokens."""
    generator = torch.Generator().manual_seed(seed)
    low, high = dictionary.nspecial, len(dictionary)
    src = torch.randint(low, high, (batch, src_len), generator=generator)
    src_lengths = torch.tensor([src_len - 2 * i for i in range(batch)]).clamp(min=2)
    for row, length in enumerate(src_lengths.tolist()):
        pad = src_len - length
        if left_pad_source:
            src[row, :pad] = dictionary.pad()
        else:
            src[row, length:] = dictionary.pad()
        src[row, -1 if left_pad_source else length - 1] = dictionary.eos()
    prev = torch.randint(low, high, (batch, tgt_len), generator=generator)
    prev[:, 0] = dictionary.eos()
    return src, src_lengths, prev


def run_distributed(command, world_size=2, timeout=600):
    """fairseq's CPU multi-process launch: one process per rank, gloo, legacy DDP (the launch
    that works without GPUs; see README). Returns rank 0's output."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(part) for part in command]
    command[0] = str(BIN / command[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    processes = [
        subprocess.Popen(command + [
            "--distributed-world-size", str(world_size), "--distributed-rank", str(rank),
            "--distributed-backend", "gloo", "--distributed-init-method", f"tcp://127.0.0.1:{port}",
            "--distributed-no-spawn", "--ddp-backend", "legacy_ddp"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for rank in range(world_size)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        if process.returncode != 0:
            raise AssertionError(f"rank failed ({process.returncode}):\n{output[-6000:]}")
    return outputs[0]


def encoding_options(*argv, **overrides):
    """The options of every registered encoding parsed from `argv` (unset ones stay None, as
    fairseq passes them), then `overrides` set by attribute name."""
    import argparse

    from posenc_fairseq.encodings import ENCODINGS

    parser = argparse.ArgumentParser()
    for name in sorted(ENCODINGS):
        ENCODINGS[name].add_args(parser)
    args = parser.parse_args([str(part) for part in argv])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def perturbed_encoding(name, *argv, dims, seed=1, scale=0.3):
    """An encoding in float64 with every parameter moved away from its (possibly zero) init."""
    from posenc_fairseq.encodings import build_encoding

    torch.manual_seed(seed)
    encoding = build_encoding(name, encoding_options(*argv), dims).double()
    with torch.no_grad():
        for parameter in encoding.parameters():
            parameter.add_(scale * torch.randn_like(parameter))
    return encoding


def attention_steps(module, encoding, x):
    """`module` (a bound decoder self-attention) called one token of x (T, B, E) at a time with an
    incremental state, as fairseq's decoder does; the steps' outputs concatenated, (T, B, E)."""
    state, steps = {}, []
    with torch.no_grad():
        for t in range(len(x)):
            encoding.begin("decoder", earlier=t)
            step = x[t: t + 1]
            steps.append(module(step, step, step, incremental_state=state, need_weights=False)[0])
    return torch.cat(steps)


def bound_attention(encoding, role, layer, embed, heads, dtype=torch.float64):
    """A self-attention PositionalAttention bound to `encoding` at (role, layer), eval mode."""
    from fairseq.modules import MultiheadAttention

    from posenc_fairseq.attention import use_positional_attention

    torch.manual_seed(0)
    module = MultiheadAttention(embed, heads, self_attention=True)
    use_positional_attention(module)
    module.bind_position(encoding, role, layer)
    return module.to(dtype).eval()


def attention_call(name, argv, role, length=11, batch=3, embed=16, heads=4):
    """A bound self-attention (float32, eval) and a call on a padded batch whose last row is all
    padding (fully masked rows), causal with one finite mask entry in the decoder."""
    from posenc_fairseq.encodings import ModelDims

    enc = perturbed_encoding(name, *argv, dims=ModelDims(embed, heads, 2, 2)).float()
    module = bound_attention(enc, role, 0, embed, heads, torch.float32)
    torch.manual_seed(3)
    x = torch.randn(length, batch, embed)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[0, -3:] = True
    padding[-1, :] = True
    mask = None
    if role == "decoder":
        mask = torch.triu(torch.full((length, length), float("-inf")), 1)
        mask[5, 2] = 0.7

    def call(need_weights=False):
        enc.begin(role)
        return module(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=need_weights)[0]

    return module, call


def assert_attention_runs_on(encoding, role_layers, length=2000, embed=32, heads=4):
    """A bound attention of `encoding` on one `length`-token sequence (causal in the decoder):
    no table sized to a maximum length, finite output."""
    x = torch.randn(length, 1, embed)
    with torch.no_grad():
        for role, layer in role_layers:
            encoding.begin(role)
            mask = torch.triu(torch.full((length, length), float("-inf")), 1) if role == "decoder" else None
            out, _ = bound_attention(encoding, role, layer, embed, heads, torch.float32)(x, x, x, attn_mask=mask)
            assert out.shape == (length, 1, embed) and torch.isfinite(out).all()


def load_script(path):
    """A script (scripts/, examples/) imported as a module by its path, to call its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_calls(monkeypatch, functions):
    """The names of `functions` ((module, name) pairs, each as imported where it is used), one
    entry per call, in the order of the calls."""
    used = []
    for module, name in functions:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, original=original, name=name, **kw: used.append(name) or original(*a, **kw))
    return used


def built_once(tmp_path_factory, name, build):
    """The folder `name` that `build(folder)` fills, made once per test run: under pytest-xdist the
    first worker that asks builds it while the others wait (a file lock), then all of them use it.
    A build that fails leaves no folder behind: the next test that asks builds it again (and fails
    the same way). What is built this way is shared: tests only read it."""
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, above the workers' own ones
    (root / "built_once").mkdir(exist_ok=True)
    folder, done = root / "built_once" / name, root / "built_once" / f"{name}.done"
    with FileLock(str(root / "built_once" / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


class HostReads(TorchDispatchMode):
    """While active, records each read of a tensor's value by the host (`int()`, `bool()`, `.item()`,
    `torch.equal`, and on a GPU a blocking copy to the CPU): on CUDA each one waits for the device.
    `reads`: (owner, function) per read, the owner being the package whose code made it
    ('posenc_fairseq', 'fairseq', or 'other'), found from the innermost frame outside torch."""
    SCALAR_READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        to_host = name in ("aten::_to_copy", "aten::copy_") and not kwargs.get("non_blocking", False) and \
            not (name == "aten::copy_" and len(args) > 2 and args[2]) and \
            any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args) and \
            isinstance(out, torch.Tensor) and out.device.type == "cpu"
        if name in self.SCALAR_READS or to_host:
            self.reads.append(self._owner())
        return out

    @staticmethod
    def _owner():
        import traceback

        for frame in reversed(traceback.extract_stack()):
            path = frame.filename.replace(os.sep, "/")
            if "/torch/" in path or path == __file__.replace(os.sep, "/") or frame.name == "__torch_dispatch__":
                continue  # (torch, and this mode's own frames or a subclass's)
            owner = "posenc_fairseq" if "/posenc_fairseq/" in path else "fairseq" if "/fairseq/" in path else "other"
            return owner, frame.name
        return "other", "?"


def sigterm_handler_of(script) -> str:
    """The module of the SIGTERM handler that `script`'s __main__ installs (run with --help):
    'posenc_fairseq.cli_signals' where SIGTERM ends it as Ctrl-C does (cli_signals.end_on_terminate)."""
    code = ("import runpy, signal, sys\nsys.argv = [sys.argv[1], '--help']\ntry:\n"
            "    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(signal.getsignal(signal.SIGTERM).__module__)")
    done = subprocess.run([sys.executable, "-c", code, str(script)], capture_output=True, text=True, timeout=300)
    return (done.stdout.splitlines() or [done.stderr[-1000:]])[-1]


def fail_at_call(monkeypatch, module, name: str, call: int, error=RuntimeError("fairseq-preprocess failed")):
    """`module.name` replaced by one that runs the original until its `call`-th call, which raises
    `error` (a step failing midway: the disk full, say); returns the list of the calls' arguments, which
    a test may clear to start counting again."""
    calls, original = [], getattr(module, name)

    def failing(*arguments):
        calls.append(arguments)
        if len(calls) == call:
            raise error
        return original(*arguments)
    monkeypatch.setattr(module, name, failing)
    return calls
