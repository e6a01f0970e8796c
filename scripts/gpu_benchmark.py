#!/usr/bin/env python
"""Speed and memory of every architecture on a GPU, as records in docs/data/gpu_benchmark.json.

On a GPU machine, from the repository root (scripts/gpu_device_setup.sh makes fairseq importable):

    bash scripts/gpu_device_setup.sh python3 scripts/gpu_benchmark.py --device cuda

For stock `transformer`, every registered encoding's `transformer_<name>`, and FLOATER once with
`--floater-recompute-every 1` (the paper's solve every update) and once with 10 (its caching; with
--floater-graphs each also with POSENC_FLOATER_CUDA_GRAPHS=1: its solve in CUDA graphs on the GPU), in bf16
and fp16 (autocast over fp32 weights, as fairseq's --amp; fp16 with a gradient scaler), at batch 16 x
512 and 2 x 4096 tokens, base size (6+6 layers, d 512, 8 heads, FFN 2048), one record per (arch,
options, dtype, batch, length):
  - train_tokens_per_s: source + target tokens per second of forward + backward + Adam step, timed by
    CUDA events (the device's time, no host noise) over the timed steps after the warm-up;
  - peak_memory_mb: torch.cuda.max_memory_allocated over those steps (weights, gradients and Adam's
    state included; resting_memory_mb is what was allocated before them);
  - generate_tokens_per_s: target tokens per second of fairseq's SequenceGenerator, beam 5, decoding
    --gen-length tokens for every source of the batch; null above --gen-max-length;
  - kernels: the attention kernels that ran in the profiled window (torch.profiler's names), and top_ops:
    where that window's time went (the 15 operations with the most self time, milliseconds per step);
    op_ms_per_step: the self time of all of them per step (CUDA: every kernel's, the GPU's busy time
    where kernels do not overlap), beside step_ms, a timed step's duration: a step much longer than its
    kernels waits on the host (launches, Python);
  - reference: the same three figures of stock `transformer` in the same run, dtype, batch and length.
A measurement that fails (out of memory, an error, the budget spent) gives nulls and an `error` string;
the others go on. Every record carries its run's label (`run`, --run): --out keeps the records of earlier
runs, each run's own compared within it, and the run's records are added to them as each model is done,
atomically (a run killed midway leaves its finished models). Then the run's table is printed (`--table`
prints every run's from the file). `--add FILE` adds a file of another run's records (a GPU machine's
$OUT/gpu_benchmark.json) to --out.

Time budget (about 8 minutes on one H100: --budget, default 420 s, for 16 models x 4 cells, plus
imports, a CUDA probe and at most GRACE_S for the last model). Each model runs in a process of its own
(its own CUDA context: peak memory and caches do not carry over), forked where a forked process can use
CUDA (`start_method`: no re-import of fairseq per model), and may use twice its fair share of the time
left; a cell that would overrun that share is recorded as not measured instead. The split is an
estimate, and each record's `wall_s` says what its cell took (docs/benchmarks.md has the first GPU
runs, where the explicit-path encodings spent their shares). Every cell of a model starts from the
weights as built. Step counts:
  - 2 warm-up steps: the first allocates (Adam's state, the allocator's blocks, cuBLAS's choices), the
    second already repeats what every later step does;
  - timed steps: at least 3 (--steps) and at least --min-seconds (1 s) of them by the warm-up's step
    time: steps of one fixed shape repeat the same kernels and events time the device alone, but a
    timing shorter than the GPU's clock ramp measures the ramp (with 3 steps, stock transformer's cells
    disagreed between two runs on one machine: docs/benchmarks.md); with --floater-recompute-every
    K > 1 the timed steps are a multiple of K (10), so that they hold exactly one solve per K updates,
    the cost the paper's caching amortises;
  - 1 profiled window apart from the timed steps (the profiler slows what it watches): one step, K
    for FLOATER with K > 1 (its solve included); the record keeps the attention kernels that ran
    (`kernels`) and the 15 operations with the most self time per step (`top_ops`, milliseconds);
  - generation: 1 untimed decode, then the median of 2, of 64 tokens; skipped at n = 4096, where a
    beam search of that source costs more of the budget than the n = 512 cell does and says the same
    about the decoder's steps.
On CPU (`--device cpu`, for the tests, with a tiny model) time.perf_counter replaces the events and
peak_memory_mb is null (scripts/benchmark.py measures a CPU step's heap).
"""
import argparse
import gc
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import at_least, check_output, markdown_table  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "data" / "gpu_benchmark.json"
REFERENCE = "transformer"
SINUSOIDAL = "transformer_sinusoidal"
FLOATER = "transformer_floater"
GRAPHS = "POSENC_FLOATER_CUDA_GRAPHS"  # FLOATER's solve in CUDA graphs (posenc_fairseq/encodings/floater/graphs.py)
TRITON = "POSENC_TRITON_ATTENTION"  # the Triton kernel of the per-distance terms (posenc_fairseq/kernels/triton_attention.py)
#: the encodings with relative terms, which that kernel serves
TRITON_SERVES = ("transformer_alibi", "transformer_at5", "transformer_at5_nob", "transformer_gcdf", "transformer_lfhc",
                 "transformer_shaw", "transformer_t5", "transformer_t5_nob", "transformer_xl")
#: those whose terms depend on the query, which the kernel serves by default on CUDA (its switch's "auto")
TRITON_BY_DEFAULT = ("transformer_gcdf", "transformer_lfhc", "transformer_shaw", "transformer_xl")
FIGURES = ("train_tokens_per_s", "peak_memory_mb", "generate_tokens_per_s")
ORDER = ("arch", "options", "device_name", "torch", "commit", "dtype", "batch", "length", *FIGURES, "reference")
# profiler names of attention kernels: fused SDPA (flash, cutlass's memory-efficient fmha, cuDNN),
# FlexAttention's Triton kernels, the explicit path's softmax; on CPU the aten operators
ATTENTION_KERNEL = re.compile(r"attention|attn|fmha|flash|flex|sdpa|softmax|triton", re.IGNORECASE)
GRACE_S = 10  # a model's process past its share by this much is killed


def load_benchmark():
    """scripts/benchmark.py as a module (its model building, training step and beam search)."""
    spec = importlib.util.spec_from_file_location("benchmark", Path(__file__).with_name("benchmark.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchmark = load_benchmark()


def batch_by_length(text: str):
    """BATCHxLENGTH, e.g. 16x512."""
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH with whole numbers >= 1 (e.g. 16x512), got {text!r}")
    return int(match[1]), int(match[2])


def seconds(text: str, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (>= 0 with `allow_zero`)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value if allow_zero else 0 < value) or not value < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds {'>=' if allow_zero else '>'} 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    return seconds(text)


def seconds_or_zero(text: str) -> float:
    return seconds(text, allow_zero=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--archs", nargs="+", metavar="ARCH",
                        help="architectures (default: every registered encoding's transformer_<name>); stock "
                             f"`{REFERENCE}` is always measured, first, as the reference; {FLOATER} is measured "
                             "once per --floater-recompute value")
    parser.add_argument("--floater-recompute", type=at_least(1), nargs="+", default=[10, 1], metavar="K",
                        help=f"{FLOATER}'s --floater-recompute-every values, one model each")
    parser.add_argument("--floater-graphs", action="store_true",
                        help=f"{FLOATER} also with its solve in CUDA graphs on the GPU ({GRAPHS}=1, "
                             "docs/floater.md), once per --floater-recompute value: against the default solve "
                             "(the CPU's compiled loops) and sinusoidal in the same run")
    parser.add_argument("--triton", action="store_true",
                        help=f"the encodings the Triton kernel serves ({', '.join(TRITON_SERVES)}) also with "
                             f"{TRITON} the other way from its default (off for {', '.join(TRITON_BY_DEFAULT)}; "
                             "on for the others), each right after its default model")
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"), default=["bf16", "fp16"])
    parser.add_argument("--sizes", nargs="+", type=batch_by_length, default=[(16, 512), (2, 4096)],
                        metavar="BATCHxLENGTH", help="batch and length (source and target) of each cell")
    parser.add_argument("--layers", type=at_least(1), default=6, help="encoder and decoder layers, each")
    parser.add_argument("--dim", type=at_least(1), default=512, help="model width (FFN: 4x)")
    parser.add_argument("--heads", type=at_least(1), default=8)
    parser.add_argument("--vocab", type=at_least(1), default=8000,
                        help="dictionary size (an IWSLT-sized joined BPE vocabulary)")
    parser.add_argument("--warmup", type=at_least(1), default=2, help="untimed training steps first")
    parser.add_argument("--steps", type=at_least(1), default=3,
                        help="timed training steps at least (FLOATER with --floater-recompute-every K > 1: a multiple of K)")
    parser.add_argument("--min-seconds", type=seconds_or_zero, default=1.0,
                        help="timed steps are added until they take this long (by the warm-up's step time): a "
                             "few short steps time the GPU's clocks ramping up more than the model")
    parser.add_argument("--beam", type=at_least(1), default=5)
    parser.add_argument("--gen-length", type=at_least(1), default=64, help="target tokens decoded")
    parser.add_argument("--gen-repeats", type=at_least(1), default=2,
                        help="timed decodes after one untimed (median)")
    parser.add_argument("--gen-max-length", type=int, default=1024,
                        help="no generation (null) for sources longer than this")
    parser.add_argument("--budget", type=positive_seconds, default=420.0,
                        help="seconds for all measurements; what does not fit is recorded as an error")
    parser.add_argument("--start", choices=("auto", "fork", "spawn"), default="auto",
                        help="how each model's process starts (auto: fork where a forked process can use the "
                             "device, else spawn)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the JSON file of records: this run's are added to those of earlier runs in it")
    parser.add_argument("--run", metavar="LABEL",
                        help="this run's label, in each of its records (default: the UTC time and the commit); "
                             "one that --out already holds is refused")
    parser.add_argument("--add", type=Path, metavar="JSON",
                        help="measure nothing: add the records of another run's file to --out (labelled --run "
                             "where given, else by their own labels)")
    parser.add_argument("--table", type=Path, nargs="?", const=DEFAULT_OUT, metavar="JSON",
                        help="only print the markdown table of a written file (default: --out's default)")
    return parser.parse_args(argv)


def models_to_measure(args):
    """[(arch, options)]: stock first (the reference), sinusoidal next, FLOATER's models after it (the
    rows of issue 36's goals, against sinusoidal's: measured before the others can spend the budget),
    the rest sorted."""
    from posenc_fairseq.encodings import ENCODINGS

    archs = args.archs or [f"transformer_{name}" for name in sorted(ENCODINGS)]
    if FLOATER in archs:  # FLOATER's goals are ratios to sinusoidal's step in the same run
        archs = [*archs, SINUSOIDAL]
    archs = list(dict.fromkeys([REFERENCE, *sorted(archs, key=lambda arch: (arch != SINUSOIDAL, arch != FLOATER, arch))]))
    models = []
    for arch in archs:
        if arch == FLOATER:
            # the value named even where it is FLOATER's default, so that each record says which it is;
            # the solve in graphs first (an environment setting in front: `measure_model` sets it in the
            # model's process), issue 36's rows, before the default solve can spend the budget
            if args.floater_graphs:
                models += [(arch, f"{GRAPHS}=1 --floater-recompute-every {k}") for k in args.floater_recompute]
            models += [(arch, f"--floater-recompute-every {k}") for k in args.floater_recompute]
        else:
            models.append((arch, ""))
            if args.triton and arch in TRITON_SERVES:  # the switch the other way from its default
                models.append((arch, f"{TRITON}={'off' if arch in TRITON_BY_DEFAULT else 'on'}"))
    return models


def unknown_archs(archs):
    from fairseq.models import ARCH_MODEL_REGISTRY

    return [arch for arch in archs if arch not in ARCH_MODEL_REGISTRY]


def cells(args):
    return [(dtype, batch, length) for dtype in args.dtypes for batch, length in args.sizes]


def record(arch, options, cell, error=None, **measured):
    dtype, batch, length = cell
    return {"arch": arch, "options": options, "dtype": dtype, "batch": batch, "length": length,
            **{figure: None for figure in FIGURES}, "kernels": None, **measured, "error": error}


# --- one model's process ---------------------------------------------------------------------------

class NotMeasured(Exception):
    """The budget left no time for this measurement."""


def measure_model(arch, options, args, deadline, path):
    """Every cell of one model, one JSON line each appended to the file `path` as it is done."""
    import torch

    import posenc_fairseq  # noqa: F401 - a spawned process starts without it

    torch.manual_seed(0)
    device = torch.device(args.device)

    def emit(line):
        with open(path, "a") as results:
            results.write(json.dumps(line) + "\n")

    words = shlex.split(options)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # NAME=value in front: this process's environment
        name, value = words.pop(0).split("=", 1)
        os.environ[name] = value
    try:
        model, task = benchmark.build_model(arch, args, device, words)
    except Exception as error:  # noqa: BLE001 - every cell of this model reports it
        traceback.print_exc()
        for cell in cells(args):
            emit(record(arch, options, cell, f"build: {short(error)}"))
        return
    window = recompute_window(options)
    # every cell starts from the weights as built: a cell's training steps must not feed the next cell
    # (FLOATER's dynamics, trained a few steps at n = 512, can overflow at n = 4096)
    # (kept on the CPU: a copy on the device would count in every cell's peak and resting memory)
    initial = {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    for cell in cells(args):
        started = time.perf_counter()
        model.load_state_dict(initial)
        try:
            measured = measure_cell(model, task, args, device, cell, window, deadline)
        except NotMeasured as reason:
            measured = {"error": f"not measured: {reason}"}
        except Exception as error:  # noqa: BLE001 - out of memory or a failure: the next cells go on
            traceback.print_exc()
            measured = {"error": short(error)}
        model.zero_grad(set_to_none=True)
        gc.collect()  # the failed cell's tensors, held by its traceback until now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emit(record(arch, options, cell, device_name=device_name(device), torch=torch.__version__,
                    wall_s=round(time.perf_counter() - started, 1), **measured))


def recompute_window(options):
    """FLOATER's K in `options` (1, its default, where not given): its cached tables are solved once
    per K updates, so the timed steps are whole windows."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--floater-recompute-every", type=int, default=1)
    return parser.parse_known_args(shlex.split(options))[0].floater_recompute_every


def timed_steps(args, window, step_seconds):
    """How many training steps to time: at least --steps and --min-seconds (by a warm-up step's
    `step_seconds`), whole windows of `window` updates (FLOATER's K)."""
    wanted = max(args.steps, math.ceil(args.min_seconds / max(step_seconds, 1e-9)))
    return math.ceil(wanted / window) * window


def measure_cell(model, task, args, device, cell, window, deadline):
    """Training speed and memory, the kernels of one step, and beam search speed of one cell;
    `window`: the timed steps are a multiple of it."""
    import torch

    dtype, batch, length = cell
    if time.time() >= deadline:
        raise NotMeasured("this model's share of the budget is spent")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    autocast = lambda: torch.autocast(device.type, dtype=half)  # noqa: E731
    low = task.source_dictionary.nspecial
    src = torch.randint(low, args.vocab, (batch, length), device=device)
    prev = torch.randint(low, args.vocab, (batch, length), device=device)
    lengths = torch.full((batch,), length, device=device)
    # fp16's loss scale starts where fairseq's --fp16-init-scale does: with torch's default (2^16) the
    # first updates overflow and are skipped, and a skipped update costs less than a real one
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**7) if dtype == "fp16" else None
    step = benchmark.training_step(model, src, lengths, prev, autocast, scaler)
    model.train()
    for _ in range(args.warmup):
        warm = seconds_of(step, device)
    steps = timed_steps(args, window, warm)
    if warm * (steps + window) > deadline - time.time():  # the timed steps and the profiled window
        raise NotMeasured(f"a step takes {warm:.1f} s; {max(0.0, deadline - time.time()):.0f} s of the budget left")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        resting = torch.cuda.memory_allocated()
    seconds = seconds_of(step, device, steps)
    result = {"train_steps": steps, "train_tokens_per_s": round(2 * batch * length * steps / seconds, 1),
              "peak_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
              "resting_memory_mb": round(resting / 2**20, 1) if cuda else None,
              "step_ms": round(1000 * seconds / steps, 3), "kernels": None, "top_ops": None}
    result["kernels"], result["top_ops"], result["op_ms_per_step"] = profiled(step, device, window)
    del step, scaler  # the optimizer's state: generation runs without it
    if length > args.gen_max_length:
        return result
    model.eval()
    decode = benchmark.beam_search(model, src, lengths, task, args)
    first = seconds_of(lambda: run_under(autocast, decode), device)
    if first * args.gen_repeats > deadline - time.time():
        return {**result, "error": f"generation not measured: a decode takes {first:.1f} s; budget spent"}
    times = [seconds_of(lambda: run_under(autocast, decode), device) for _ in range(args.gen_repeats)]
    return {**result, "generate_tokens_per_s": round(batch * args.gen_length / statistics.median(times), 1)}


def run_under(context, run):
    with context():
        return run()


def seconds_of(run, device, repeats=1):
    """Seconds of `repeats` calls of `run`: on CUDA between two events (the device's time from the
    first kernel to the last), on CPU by the wall clock."""
    import torch

    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


def profiled(step, device, steps=1, most=6, top=15):
    """What the profiler saw over `steps` calls of `step` (one K-window for FLOATER: its solve
    included), not what the code meant to call: (the attention kernels (CUDA) or operators (CPU),
    the longest-running first; the `top` operations by self time on the device (CUDA kernels) or
    the CPU (aten operators) as [name, milliseconds per step]; the self time of all of them,
    milliseconds per step). The second says where a slow encoding's step goes, the third how much of
    the step the device (or the operators) is busy."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    totals = {}
    for event in profiler.key_averages():
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        # on CPU the aten operators only: not autograd's nodes, which name the same work again
        if on_device != cuda or not (cuda or event.key.startswith("aten::")):
            continue
        spent = getattr(event, "self_device_time_total", None) if cuda else event.self_cpu_time_total
        totals[event.key] = totals.get(event.key, 0) + (spent or 0)
    longest = sorted(totals, key=totals.get, reverse=True)
    attention = [name[:120] for name in longest if ATTENTION_KERNEL.search(name)][:most]
    return (attention, [[name[:120], round(totals[name] / steps / 1000, 3)] for name in longest[:top]],
            round(sum(totals.values()) / steps / 1000, 3))


def device_name(device):
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()})"


def short(error):
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:300]


# --- the run ---------------------------------------------------------------------------------------

def run_all(args, run=None, device=None, save=None):
    """Each model in a process of its own within its share of the budget; returns every cell's record,
    each with `run` = `run` (its label) and, where its model did not measure it, `device` as its device_name;
    `save(records so far)` after each model."""
    import torch

    from posenc_fairseq.provenance import source_commit

    models = models_to_measure(args)
    end = time.time() + args.budget
    context = multiprocessing.get_context(start_method(args))
    run_commit, records = source_commit(), []

    def finished():
        for item in records:
            item.setdefault("device_name", device)
            item.setdefault("torch", torch.__version__)
            item["commit"] = run_commit
            item["model"] = {"layers": args.layers, "dim": args.dim, "heads": args.heads, "ffn": 4 * args.dim,
                             "vocab": args.vocab}
            item["run"] = run
        add_references(records)
        return [{key: item[key] for key in ORDER if key in item} | item for item in records]

    with tempfile.TemporaryDirectory(prefix="gpu_benchmark_") as folder:
        for index, (arch, options) in enumerate(models):
            left = end - time.time()
            if left <= 0:
                records += [record(arch, options, cell, f"not measured: --budget {args.budget:g} s spent")
                            for cell in cells(args)]
            else:
                share = min(left, 2 * left / (len(models) - index))
                records += measure_in_process(context, arch, options, args, share, Path(folder, f"{index}.jsonl"))
            if save:
                save(finished())
    return finished()


def measure_in_process(context, arch, options, args, share, path):
    """One model's records, measured in a process of its own (its cells appended to the file `path`),
    killed `share` + GRACE_S seconds from now: what it had not measured then is recorded as such."""
    print(f"gpu_benchmark: {f'{arch} {options}'.strip()} ({share:.0f} s at most)", file=sys.stderr, flush=True)
    path.touch()
    child = context.Process(target=measure_model, args=(arch, options, args, time.time() + share, path))
    child.start()
    try:
        child.join(share + GRACE_S)
    except BaseException:  # Ctrl-C, or SIGTERM to this process alone: the model's process ends with it
        child.kill()
        child.join()
        raise
    killed = child.is_alive()
    if killed:
        child.kill()
        child.join()
    done = {(r["dtype"], r["batch"], r["length"]): r for r in map(json.loads, path.read_text().splitlines())}
    why = (f"not measured: {share:.0f} s, its share of --budget, spent" if killed
           else f"not measured: its process stopped (exit code {child.exitcode})")
    return [done.get(cell) or record(arch, options, cell, why) for cell in cells(args)]


def start_method(args):
    """How each model's process starts. A forked one keeps fairseq imported (a fresh interpreter
    imports it again for every model, out of the budget), but a process that has started CUDA cannot
    be forked into one that uses it: torch says the parent's imports leave it unstarted where NVML
    answers. `--start auto` forks a child that touches the GPU, and spawns where that child fails."""
    if args.start != "auto":
        return args.start
    if args.device != "cuda":
        return "fork"
    probe = multiprocessing.get_context("fork").Process(target=touch_cuda)
    probe.start()
    probe.join(120)
    if probe.is_alive():
        probe.kill()
        probe.join()
    chosen = "fork" if probe.exitcode == 0 else "spawn"
    print(f"gpu_benchmark: a forked process {'can' if chosen == 'fork' else 'cannot'} use CUDA: {chosen}",
          file=sys.stderr, flush=True)
    return chosen


def touch_cuda():
    import torch

    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()


def add_references(records):
    """Each record's `reference`: stock transformer's figures in the same dtype, batch and length."""
    stock = {run_cell(item): item for item in records if item["arch"] == REFERENCE and item["options"] == ""}
    for item in records:
        reference = stock.get(run_cell(item), {})
        item["reference"] = {figure: reference.get(figure) for figure in FIGURES}


def cell_of(item):
    return item["dtype"], item["batch"], item["length"]


def run_cell(item):
    """The cell within its run: a file that joins several runs (a `run` field) compares within each."""
    return item.get("run"), *cell_of(item)


def write_atomically(path, records):
    """The JSON list in a temporary file beside `path`, then renamed over it: a reader sees the old
    file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    try:
        with handle:
            json.dump(records, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise


# --- the table -------------------------------------------------------------------------------------

def run_tables(records):
    """The records as markdown tables, one per run (`run_table`)."""
    runs = dict.fromkeys(item.get("run") for item in records)
    return "\n\n".join(run_table([item for item in records if item.get("run") == run]) for run in runs)


def run_table(records):
    """One run's records as a markdown table: each figure with its ratio to stock `transformer` (tokens/s:
    higher is better; memory: lower), and FLOATER's step time over transformer_sinusoidal's in the
    same dtype, batch and length (issue 36's goals: <= 1.5 with K = 1, <= 1.1 with K = 10), and how busy
    the step keeps the device (`op_ms_per_step` / `step_ms`)."""
    sinusoidal = {run_cell(item): item for item in records if item["arch"] == SINUSOIDAL and item["options"] == ""}
    first = next((item for item in records if item.get("device_name")), records[0] if records else {})
    header = ["arch", "options", "dtype", "batch x n", "train tok/s", "x stock", "peak MB", "x stock", "beam gen tok/s",
              "x stock", "step / sinusoidal's", "busy", "attention kernels", "error"]
    rows = []
    for item in records:
        reference = item["reference"]
        row = [item["arch"], f"`{item['options']}`" if item["options"] else "", item["dtype"],
               f"{item['batch']} x {item['length']}"]
        for figure in FIGURES:
            row += [number(item[figure], ".0f"), ratio(item[figure], reference[figure])]
        floater_vs_sinusoidal = ""
        if item["arch"] == FLOATER:  # step time ratio: the inverse of the tokens/s ratio
            floater_vs_sinusoidal = ratio(sinusoidal.get(run_cell(item), {}).get("train_tokens_per_s"),
                                          item["train_tokens_per_s"])
        # the operators' (CUDA: kernels') time per step over the step's duration (older records: none)
        busy = ratio(item.get("op_ms_per_step"), item.get("step_ms"))
        rows.append(row + [floater_vs_sinusoidal, busy,
                           ", ".join(f"`{name[:60]}`" for name in (item.get("kernels") or [])[:3]),
                           (item.get("error") or "").replace("|", "/")[:120]])
    return "\n".join([f"Run {first.get('run')}: {first.get('device_name')}, torch {first.get('torch')}, commit "
                      f"{first.get('commit')}; ratios to stock `transformer` in the same run, dtype, batch and length",
                      "", *markdown_table(header, rows)])


def number(value, spec):
    return "—" if value is None else format(value, spec)


def ratio(value, reference):
    return "—" if value is None or not reference else f"{value / reference:.2f}"


class Refused(Exception):
    """Nothing measured or written: the message says why."""


def refuse(message):
    """A `fail` for script_helpers' checks."""
    raise Refused(message)


def read_records(path):
    """The records (a JSON list of objects) of the file `path`."""
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise Refused(f"{path}: not a file of records ({short(error)})") from None
    if not isinstance(records, list) or not all(isinstance(item, dict) for item in records):
        raise Refused(f"{path}: not a file of records (a JSON list of objects)")
    return records


def runs_of(records):
    return {item.get("run") for item in records}


def add_run(args, earlier):
    """--add: the records of another run's file added to --out's, labelled --run where given."""
    if args.add.resolve() == args.out.resolve():
        raise Refused(f"--add {args.add} is --out")
    added = read_records(args.add)
    for item in added:
        item["run"] = args.run or item.get("run")
    if None in runs_of(added):
        raise Refused(f"{args.add} has records without a run label: give one with --run")
    taken = sorted(runs_of(added) & runs_of(earlier))
    if taken:
        raise Refused(f"{args.out} already holds the run(s) {'; '.join(taken)}: give another --run")
    write_atomically(args.out, earlier + added)
    print(f"gpu_benchmark: {len(added)} records of {'; '.join(sorted(runs_of(added)))} added to {args.out}",
          file=sys.stderr)


def probe_device(args):
    """The device's name, asked in a process of its own: CUDA must not start in this one before the fork."""
    if args.device != "cuda":
        import torch

        return device_name(torch.device(args.device))
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available() "
                                                  "and torch.cuda.get_device_name(0))"], capture_output=True, text=True)
    name = probe.stdout.strip()
    if probe.returncode != 0 or name in ("", "False"):
        raise Refused("--device cuda but torch sees no CUDA device (--device cpu measures on the CPU)")
    return name


def measure(args, earlier):
    """The run: its records added to --out's as each model is done."""
    import posenc_fairseq  # noqa: F401 - registers the architectures
    from posenc_fairseq.provenance import source_commit

    label = args.run or f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {source_commit()}"
    if label in runs_of(earlier):
        raise Refused(f"{args.out} already holds the run {label}: give another --run")
    unknown = unknown_archs(args.archs or [])
    if unknown:
        raise Refused(f"unknown architecture(s) {', '.join(unknown)}; nothing measured, {args.out} not written")
    device = probe_device(args)
    records = run_all(args, label, device, save=lambda records: write_atomically(args.out, earlier + records))
    write_atomically(args.out, earlier + records)
    print(run_tables(records))
    failed = sum(item["error"] is not None for item in records)
    print(f"\ngpu_benchmark: {len(records)} records of the run {label} in {args.out}, {failed} with an error",
          file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.table is not None:
            print(run_tables(read_records(args.table)))
            return 0
        # --out a folder, or in one that cannot be made: said now, not after the first model is measured
        check_output(args.out, [], refuse)
        earlier = read_records(args.out) if args.out.exists() else []
        (add_run if args.add is not None else measure)(args, earlier)
    except Refused as reason:
        print(f"gpu_benchmark: {reason}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from posenc_fairseq.cli_signals import end_on_terminate

    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    sys.exit(main())
