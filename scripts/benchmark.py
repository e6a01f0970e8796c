#!/usr/bin/env python
"""Speed and memory of every architecture, as ratios to `transformer_sinusoidal` in the same run.

For each architecture a fresh subprocess builds the model (same size for all), then measures
  - training tokens/s: forward + backward + Adam step on random batches of `--length` tokens,
  - CUDA: peak memory of one training step above the resting allocation (`peak MB`),
  - CPU: `heap MB`, the peak of malloc's bytes in use during one more (untimed) training step
    (it repeats exactly from run to run; the process's RSS high-water mark includes model building
    and cannot be reset, so it measures no step),
  - generation tokens/s: step-by-step (incremental) greedy decoding of `--gen-length` tokens,
  - beam search tokens/s: fairseq's SequenceGenerator (as fairseq-generate) with `--beam 5` (0: no column),
    both the median of `--gen-repeats` decodes after an untimed one, alternating with the reference
    model built in the same process (the generation ratios are taken within that process; so is the
    training ratio: after the solo timing, which gives the memory, --steps more updates of each
    model alternate, median per update). Each process builds `--copies` copies of both models,
    interleaved, and a model's time is the geometric mean over its copies (copies of one model differ
    in speed by where their tensors land). The order alternates too: the architecture first in even
    rounds, the reference first in odd ones (`alternating_medians`), for --growth as well; and so does
    the order the two models are built in (odd rounds build the reference first).
`--growth` prints instead, per arch, the training time per step at n = 128 and 2048 (batch 1) and
its growth exponent log(t2048/t128)/log(16) next to the reference's.
Timings on a shared machine vary from call to call, so every architecture is measured `--repeats`
times, the architectures alternating (round robin), each in a process with `--threads` torch
threads; the table gives the median ratio to the reference measured in the same round, and the
range of the ratios over the rounds. A measurement that fails (its error printed) leaves its cells
out (`-`); the others still run and are printed, and the exit status is then 1.
Usage: benchmark.py [--archs transformer_sinusoidal transformer_t5 ...] [--length 1024] [--repeats 5]
       benchmark.py --growth [--archs ...] [--repeats 3]
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import at_least  # noqa: E402


def measure(arch, args):
    import torch

    import posenc_fairseq  # noqa: F401

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)

    def build(name):
        return build_model(name, args, device, args.extra)

    # Identical copies of one model, built one after the other in one process, decode at speeds
    # apart by more than the gaps measured, each copy steadily (docs/benchmarks.md): where a copy's
    # tensors land in memory matters.
    # So each model is built --copies times, the two interleaved (arch, reference, reference, arch,
    # ...; odd rounds start with the reference: the model built first measured slower), and its
    # figures are the geometric means over its copies.
    copies = []  # (prefix, copy index, model)
    for name, index in build_order(arch, args.reference, args.copies, args.reference_first):
        model, task = build(name)
        copies.append(("" if name == arch else "reference_", index, model))
    model = next(net for prefix, _, net in copies if prefix == "")
    low = 4
    src = torch.randint(low, args.vocab, (args.batch, args.length), device=device)
    prev = torch.randint(low, args.vocab, (args.batch, args.length), device=device)
    lengths = torch.full((args.batch,), args.length, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    steps = {(prefix, index): training_step(net.train(), src, lengths, prev) for prefix, index, net in copies}
    step = steps[("", 0)]
    for _ in range(args.warmup):  # first allocations (optimizer state; FLOATER K > 1: the window's solve)
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    memory = {"peak_memory_mb": (torch.cuda.max_memory_allocated() - base) / 2**20} if device.type == "cuda" else {}
    train_tps = 2 * args.batch * args.length * args.steps / elapsed  # source + target tokens
    heap = heap_peak_bytes(step) if device.type == "cpu" and not args.train_only else None  # one more, untimed step

    result = {"arch": arch, "train_tokens_per_s": train_tps, **memory}
    if heap is not None:
        result["heap_peak_mb"] = heap / 2**20
    # Training again, and generation: every copy of this model and the reference, alternating step by
    # step (decode by decode): a process's own speed (which varies from process to process on a
    # shared machine) then cancels in the ratio
    if len(steps) > 1:
        for key, run in steps.items():
            if key != ("", 0):
                for _ in range(args.warmup):
                    run()
        for prefix, seconds in over_copies(alternating_medians(steps, args.steps, sync)).items():
            result[prefix + "train_tokens_per_s"] = 2 * args.batch * args.length / seconds
            result[prefix + "train_seconds_per_step"] = seconds
    else:
        result["train_seconds_per_step"] = elapsed / args.steps
    if args.train_only:
        return result
    for _, _, net in copies:
        net.eval()
    greedy = {(prefix, index): greedy_decode(net, src[:1], lengths[:1], task, args) for prefix, index, net in copies}
    for prefix, seconds in over_copies(alternating_medians(greedy, args.gen_repeats, sync)).items():
        result[prefix + "generate_tokens_per_s"] = args.gen_length / seconds
    if args.beam > 0:
        beams = {(prefix, index): beam_search(net, src[:1], lengths[:1], task, args) for prefix, index, net in copies}
        for prefix, seconds in over_copies(alternating_medians(beams, args.gen_repeats, sync)).items():
            result[prefix + "beam_tokens_per_s"] = args.gen_length / seconds
    return result


def build_order(arch: str, reference: str, copies: int, reference_first: bool) -> list:
    """[(name, copy index)] in the order a measuring process builds them: `copies` of each, the two
    models interleaved so that neither is always built first (arch, reference, reference, arch, ...,
    or from the reference with `reference_first`); the reference alone where it is the arch."""
    names = [arch] if arch == reference else [arch, reference]
    return [(name, index) for index in range(copies)
            for name in (names if (index + reference_first) % 2 == 0 else names[::-1])]


def over_copies(seconds: dict) -> dict:
    """{prefix: geometric mean of the seconds of its copies} from {(prefix, copy index): seconds}."""
    import math

    logs = {}
    for (prefix, _), value in seconds.items():
        logs.setdefault(prefix, []).append(math.log(value))
    return {prefix: math.exp(statistics.fmean(values)) for prefix, values in logs.items()}


def build_model(name, args, device, extra):
    """(model, task): `name` built as fairseq-train builds it for translation, on a dictionary of
    args.vocab words, args.layers + args.layers layers of width args.dim with args.heads heads and an
    FFN of 4 x args.dim, `extra` (further model options) last, moved to `device`."""
    from fairseq import options, tasks

    with tempfile.TemporaryDirectory() as data:
        for lang in ("src", "tgt"):
            Path(data, f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(args.vocab)))
        parser = options.get_training_parser()
        model_args = options.parse_args_and_arch(parser, [
            data, "--task", "translation", "-s", "src", "-t", "tgt", "--arch", name, "--user-dir",
            str(REPO / "posenc_fairseq"), "--max-source-positions", "100000", "--max-target-positions", "100000",
            "--encoder-layers", str(args.layers), "--decoder-layers", str(args.layers),
            "--encoder-embed-dim", str(args.dim), "--decoder-embed-dim", str(args.dim),
            "--encoder-ffn-embed-dim", str(4 * args.dim), "--decoder-ffn-embed-dim", str(4 * args.dim),
            "--encoder-attention-heads", str(args.heads), "--decoder-attention-heads", str(args.heads),
            *extra])
        task = tasks.setup_task(model_args)
        return task.build_model(model_args).to(device), task


def training_step(net, src, lengths, prev, autocast=None, scaler=None):
    """One training update of `net` (forward, backward, Adam) on the batch (src, lengths, prev) as a
    function to time. `autocast`: a context factory the forward runs under (mixed precision, as
    fairseq's --amp); `scaler`: fp16's gradient scaler. Each call counts one update, as fairseq's
    trainer does (FLOATER's --floater-recompute-every window follows it)."""
    import torch

    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    updates = [0]

    def step():
        updates[0] += 1
        net.set_num_updates(updates[0])
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits, _ = net(src, lengths, prev)
            loss = logits.float().logsumexp(-1).mean()
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return step


def greedy_decode(model, src, lengths, task, args):
    """Step-by-step (incremental) greedy decoding of --gen-length tokens, as a function to time."""
    import torch

    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)

    @torch.no_grad()
    def run():
        tokens = torch.full((1, 1), task.target_dictionary.eos(), device=src.device)
        state = {}
        for _ in range(args.gen_length):
            logits, _ = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return run


def beam_search(model, src, lengths, task, args):
    """fairseq's SequenceGenerator (what fairseq-generate runs) with --beam args.beam on one source
    sentence, exactly --gen-length target tokens (min = max length), as a function to time."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], task.target_dictionary, beam_size=args.beam, max_len_a=0,
                                  max_len_b=args.gen_length, min_len=args.gen_length)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    return lambda: generator.generate([model], sample)


def alternating_medians(runs, repeats, sync):
    """Median wall time of each of `runs` (name -> function) over `repeats` rounds that call them in
    turn, after one untimed call each (first allocations and kept values). Odd rounds call them in
    reverse order: running first in a round changes the time measured (the same model against itself
    gave ratios below 1 in a fixed order: docs/benchmarks.md), so neither may always run first."""
    times = {name: [] for name in runs}
    for name, run in runs.items():
        run()
    order = list(runs.items())
    for round_index in range(repeats):
        for name, run in order if round_index % 2 == 0 else order[::-1]:
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def heap_peak_bytes(step):
    """CPU: peak of the bytes malloc has handed out (glibc mallinfo2, sampled after every torch op)
    during one training step, above the bytes in use before it. Unlike RSS it does not depend on
    what the allocator kept from earlier steps, so it repeats exactly from run to run. None where
    mallinfo2 is not available."""
    import ctypes
    import gc

    from torch.utils._python_dispatch import TorchDispatchMode

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2

    def in_use():
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    class Sample(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Sample.peak = max(Sample.peak, in_use())
            return out

    gc.collect()
    before = Sample.peak = in_use()
    with Sample():
        step()
    return Sample.peak - before


def unknown_archs(names) -> list:
    """The names among `names` that fairseq does not know as architectures, this package's included."""
    import posenc_fairseq  # noqa: F401  (registers the transformer_* architectures)
    from fairseq.models import ARCH_MODEL_REGISTRY

    return [name for name in dict.fromkeys(names) if name not in ARCH_MODEL_REGISTRY]


def measure_in_process(arch, label, options, threads, failed: list):
    """One measurement (`--one arch`) in a process of its own (peak memory and warm caches stay
    separate): its figures, or None after its error is printed and `label` added to `failed`."""
    done = subprocess.run([sys.executable, __file__, "--one", arch, *options], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if done.returncode != 0:
        print(f"{label}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        failed.append(arch)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def exit_if_failed(failed: list):
    """After the table: measurements that failed (each one's error printed above) make the exit status 1."""
    if failed:
        raise SystemExit(f"error: {len(failed)} measurement(s) failed ({', '.join(dict.fromkeys(failed))}); "
                         "their errors are printed above")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # every size and count has a lower bound, checked here: a bad one would otherwise fail in (or, as a
    # negative --length, past) every measuring process; counts of timings are >= 1 (no median of none)
    parser.add_argument("--archs", nargs="+", default=[
        "transformer_sinusoidal", "transformer_alibi", "transformer_rotary", "transformer_t5", "transformer_t5_nob",
        "transformer_at5", "transformer_at5_nob", "transformer_shaw", "transformer_lfhc", "transformer_xl", "transformer_gcdf",
        "transformer_floater"])
    parser.add_argument("--length", type=at_least(1), default=256)
    parser.add_argument("--batch", type=at_least(1), default=4)
    parser.add_argument("--dim", type=at_least(1), default=256)
    parser.add_argument("--heads", type=at_least(1), default=4)
    parser.add_argument("--layers", type=at_least(1), default=2)
    # (token ids are drawn from 4, past the dictionary's special symbols, to --vocab)
    parser.add_argument("--vocab", type=at_least(5), default=1000)
    parser.add_argument("--steps", type=at_least(1), default=8,
                        help="timed training steps (solo for tokens/s and memory, then alternating with the "
                             "reference: median per update; 3 gave round-to-round ranges of +-0.02-0.05)")
    parser.add_argument("--warmup", type=at_least(0), default=3,
                        help="untimed training steps first: the allocator and caches settle, and with "
                             "--floater-recompute-every K > 1 the window's solve (1 step in K) is among them")
    parser.add_argument("--gen-length", type=at_least(1), default=64)
    parser.add_argument("--gen-repeats", type=at_least(1), default=5,
                        help="timed decodes per measurement (greedy and beam, alternating with the reference "
                             "in the same process), after one untimed: median")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch threads of each measuring process")
    parser.add_argument("--copies", type=at_least(1), default=2,
                        help="copies of each model built in each measuring process, interleaved with the "
                             "reference's (timings: geometric mean over the copies)")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="rounds over all architectures (median reported)")
    parser.add_argument("--reference", default="transformer_sinusoidal")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="further model options for every arch, e.g. --extra --floater-recompute-every 400")
    parser.add_argument("--beam", type=at_least(0), default=5,
                        help="beam size of the fairseq SequenceGenerator column (beam5 tok/s); 0 leaves it out")
    parser.add_argument("--growth", action="store_true",
                        help="instead of the table: training time per step at n = 128 and 2048 (batch 1, "
                             "--growth-lengths) and its growth exponent log(t2048/t128)/log(16) per arch")
    parser.add_argument("--growth-lengths", type=at_least(1), nargs=2, default=[128, 2048], metavar=("SHORT", "LONG"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--train-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return
    if args.growth_lengths[0] >= args.growth_lengths[1]:  # (the exponent divides by log(LONG / SHORT))
        parser.error(f"--growth-lengths {' '.join(map(str, args.growth_lengths))}: expected SHORT < LONG")
    # before any measuring: an unknown name would fail in every one of its processes
    unknown = unknown_archs([args.reference, *args.archs])
    if unknown:
        parser.error(f"unknown architecture(s): {', '.join(unknown)} (not fairseq's, nor this package's)")
    if args.growth:
        growth(args)
        return
    archs = list(dict.fromkeys([args.reference, *args.archs]))
    rounds, failed = [], []
    for round_index in range(args.repeats):  # round robin: a slow period of the machine hits every arch alike
        measured = {}
        order = ["--reference-first"] if round_index % 2 else []  # which model the process builds first
        for arch in archs:
            figures = measure_in_process(arch, arch, [*order, *sys.argv[1:]], args.threads, failed)
            if figures is not None:
                measured[arch] = figures
        if args.reference in measured:
            rounds.append(measured)
    print(f"length {args.length}, batch {args.batch}, dim {args.dim}, {args.layers}+{args.layers} layers, "
          f"{args.device}, {args.threads} threads, {len(rounds)} rounds; ratios to {args.reference}: median [min-max]")
    columns = (("train_tokens_per_s", "train tok/s"),)
    if args.device != "cpu":
        columns += (("peak_memory_mb", "peak MB"),)
    columns += (("generate_tokens_per_s", "gen tok/s"),)
    if args.beam > 0:
        columns += (("beam_tokens_per_s", f"beam{args.beam} tok/s"),)
    if args.device == "cpu":
        columns += (("heap_peak_mb", "heap MB"),)
    print(f"{'arch':40s}" + "".join(f" {title:>12s} {'ratio':>18s}" for _, title in columns))
    for arch in archs:
        line = f"{arch:40s}"
        for key, _ in columns:
            values = [r[arch][key] for r in rounds if arch in r]
            # (training and generation: against the reference run in the same process, where measured)
            ratios = sorted(r[arch][key] / max(r[arch].get("reference_" + key, r[args.reference][key]), 1e-9)
                            for r in rounds if arch in r)
            if not ratios:
                line += f" {'-':>12s} {'-':>18s}"
                continue
            line += f" {statistics.median(values):12.1f} {statistics.median(ratios):6.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
        print(line)
    exit_if_failed(failed)


def growth(args):
    """Training time per step at a short and a long length (batch 1), each arch in its own process
    beside the reference (built in the same process, steps alternating: `measure`), rounds
    alternating the archs. Exponent = log(t_long / t_short) / log(long / short) (1: linear,
    2: quadratic); its difference to the reference's is taken from the ratios within each process,
    log(r_long / r_short) / log(long / short) with r = t_arch / t_reference, so a process's own speed
    cancels. Median and range over the rounds."""
    import math

    short, long = args.growth_lengths
    archs = list(dict.fromkeys([args.reference, *args.archs]))
    base = ["--dim", str(args.dim), "--heads", str(args.heads), "--layers", str(args.layers), "--vocab",
            str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
            "--threads", str(args.threads), "--batch", "1", "--train-only", "--reference", args.reference,
            "--copies", str(args.copies)]
    exponents = {arch: [] for arch in archs}
    differences = {arch: [] for arch in archs}
    times = {(arch, n): [] for arch in archs for n in (short, long)}
    scale = math.log(long / short)
    failed = []
    for _ in range(args.repeats):
        for arch in archs:
            measured = {}
            for n in (short, long):
                figures = measure_in_process(arch, f"{arch} (n = {n})", [*base, "--length", str(n), "--extra",
                                                                         *args.extra], args.threads, failed)
                if figures is None:
                    break
                measured[n] = figures
                times[(arch, n)].append(measured[n]["train_seconds_per_step"])
            if len(measured) == 2:
                seconds = {n: measured[n]["train_seconds_per_step"] for n in (short, long)}
                exponents[arch].append(math.log(seconds[long] / seconds[short]) / scale)
                ratio = {n: seconds[n] / measured[n].get("reference_train_seconds_per_step", seconds[n])
                         for n in (short, long)}
                differences[arch].append(math.log(ratio[long] / ratio[short]) / scale)
    print(f"training time per step at n = {short} and {long}, batch 1, dim {args.dim}, {args.layers}+{args.layers} "
          f"layers, {args.device}, {args.threads} threads, {args.repeats} rounds; exponent log(t{long}/t{short})/"
          f"log({long // short}), and its difference to {args.reference}'s from the ratios within each process: "
          f"median [min-max]")
    print(f"{'arch':40s} {'s/step n=' + str(short):>14s} {'s/step n=' + str(long):>15s} {'exponent':>22s} "
          f"{'- reference':>22s}")
    for arch in archs:
        values, spread = sorted(exponents[arch]), sorted(differences[arch])
        if not values:
            print(f"{arch:40s} {'-':>14s} {'-':>15s} {'-':>22s}")
            continue
        print(f"{arch:40s} {statistics.median(times[(arch, short)]):14.3f} {statistics.median(times[(arch, long)]):15.3f} "
              f"{statistics.median(values):6.2f} [{values[0]:.2f}-{values[-1]:.2f}]{'':>5s} "
              f"{statistics.median(spread):+6.2f} [{spread[0]:+.2f}-{spread[-1]:+.2f}]")
    exit_if_failed(failed)


if __name__ == "__main__":
    main()
