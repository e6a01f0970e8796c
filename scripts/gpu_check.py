#!/usr/bin/env python
"""What only a GPU shows: which attention kernel ran and what it compiled, and what a step costs.

    python scripts/gpu_check.py --device cuda            # within its budgets: b 240 s, e 60 s
    python scripts/gpu_check.py --device cpu [--quick]   # what the CPU can run of it

Whether every encoding computes on CUDA what it computes on the CPU is the test suite's part: the tests
a GPU changes take their device from --device (every encoding's forward and backward, fp16 / bf16 /
autocast, DDP with NCCL and checkpointing, decoding steps against the full pass, FLOATER's table, T5's
buckets), with their bounds per device in tests/devices.py:

    make test-cuda        # pytest tests -m device --device cuda, a JUnit report of what ran

(This script's former checks a, c, d, f, g and e's table did the same with bounds of their own: removed.)

Checks (each prints a markdown table and its elapsed seconds; `--only b` picks some):
  b. FlexAttention (POSENC_FLEX_ATTENTION=train: with gradients on CUDA) against the reference path ("off")
     for the encodings whose per-distance table it reads (`distance.flex_table`): how many calls took
     FlexAttention, logits and every gradient over batches of mixed lengths and padding, Dynamo's
     compiles (a recompile limit reached or a failed compile shows as frames not compiled), and
     forward + backward time of both. CPU: forward only under no_grad (FlexAttention's eager CPU path
     has no backward).
  t. The Triton kernel (POSENC_TRITON_ATTENTION=on) against the other paths ("off": the reference), for every
     encoding with relative terms: how many calls took it, logits and every gradient over batches of
     mixed lengths and padding (forward and backward on CPU too, in Triton's interpreter, which the
     script turns on there), half-precision models and a source row all padding, and forward +
     backward time of both on CUDA. Checks b and t measure both paths from a float64 copy of the
     model on the reference paths: a row passes where the path is within its limit of it, or no
     more than TRUTH_FACTOR times as far from it as the reference paths are (rounding in another order).
  e. FLOATER's cost: the time of a training step (its table solved every step) against
     transformer_sinusoidal of the same size, and on CUDA the peak memory of each (reported, no limit).
A failing row does not stop the others; a check that spends its time budget (`--budget`) reports
the rows it did not run as failures. Exit status 1 if any row failed. Check b runs last: it
compiles, the slowest and least predictable part. b and t share their comparison (`compare_paths`).
"""
import argparse
import logging
import math
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
USER_DIR = str(REPO / "posenc_fairseq")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from script_helpers import markdown_table  # noqa: E402

# The letters are the former run's (docs/gpu_check.md's records name them): a, c, d, f, g are the test suite's now.
CHECKS = {
    "b": "FlexAttention vs the reference attention",
    "e": "FLOATER's cost: step time (and CUDA memory) vs sinusoidal",
    "t": "the Triton kernel vs the other paths",
}
RUN_ORDER = "etb"
#: the former checks, which the test suite runs on --device cuda now
MOVED = "acdfg"
#: seconds per check on CUDA (`--budget` overrides): together well under the device run's limit with set-up;
#: CPU and --quick runs are small enough not to need one
CUDA_BUDGETS = {"b": 240, "e": 60, "t": 120}
CPU_BUDGETS = {"b": 300, "e": 300, "t": 300}

NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]


def sizes(dim, heads, layers, ffn=None):
    """fairseq's size options of an encoder-decoder transformer."""
    ffn = ffn or 2 * dim
    return ["--encoder-layers", str(layers), "--decoder-layers", str(layers),
            "--encoder-embed-dim", str(dim), "--decoder-embed-dim", str(dim),
            "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
            "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads)]


#: FlexAttention's CUDA kernel needs a head dimension of at least 16
FLEX_SIZES = sizes(64, 4, 2)
#: options that give an encoding a term FlexAttention can read (Shaw's default value term needs the explicit path)
FLEX_OPTIONS = {"shaw": ["--shaw-values", "off"]}
#: the flex check runs these first (one of each kind of table) so that a spent budget still covers every kind
FLEX_FIRST = ["t5", "alibi", "xl", "lfhc", "shaw"]
#: the Triton check's first (a bias; vectors shared by the heads with a value term; per-head vectors)
TRITON_FIRST = ["t5", "shaw", "xl"]

# Check b's pass limits, FlexAttention against the reference path. fp32: rounding only.
FP32_LIMIT = 1e-4
#: half-precision models: logits and gradients, relative. bf16 keeps 8 bits of mantissa, fp16 11; a position
#: term dropped moves the gradients by ~100 %
HALF_LIMITS = {torch.float16: 1e-1, torch.bfloat16: 2e-1}
#: fairseq's --fp16 starts its loss scale at 2**7: without one, small fp16 gradients flush to zero
FP16_LOSS_SCALE = 128.0


# --- reporting ----------------------------------------------------------------------------------
class CheckFailed(Exception):
    """A row's comparison failed: the message is the row's detail."""


@dataclass
class Row:
    cells: dict
    status: str  # PASS, FAIL, SKIP (not applicable here), INFO (a measurement without a limit)
    detail: str = ""


class Table:
    def __init__(self, key, columns):
        self.key, self.columns, self.rows = key, columns, []
        self.note = ""  # printed under the table

    def add(self, status, detail="", **cells):
        self.rows.append(Row(cells, status, detail))

    def markdown(self):
        def cell(value):  # one table cell
            return "—" if value is None else str(value).replace("|", "/").replace("\n", " ")

        return "\n".join(markdown_table([*self.columns, "status", "detail"], (
            [cell(row.cells.get(column, "")) for column in self.columns] + [cell(row.status), cell(row.detail)]
            for row in self.rows)))

    def count(self, status):
        return sum(row.status == status for row in self.rows)


class Budget:
    def __init__(self, seconds):
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self):
        return time.perf_counter() - self.start

    def spent(self):
        return self.elapsed() > self.seconds


def short_error(error):
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def guarded(table, budget, label_column, label, make_row):
    """One row: make_row() -> (cells, status, detail); an exception becomes a FAIL row (traceback on
    stderr), and so does a row the check's time budget leaves no time for."""
    if budget.spent():
        table.add("FAIL", f"not run: the check's time budget ({budget.seconds:g} s) was spent", **{label_column: label})
        return
    try:
        cells, status, detail = make_row()
    except CheckFailed as failure:
        cells, status, detail = {}, "FAIL", str(failure)
    except Exception as error:  # noqa: BLE001 - one failing row must not end the acceptance run
        print(f"\n--- {table.key} / {label}: {type(error).__name__}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        cells, status, detail = {}, "FAIL", short_error(error)
    table.add(status, detail, **{label_column: label, **cells})


def fmt(value):
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.2e}" if value != 0 else "0"
    return str(value)


# --- models and data ------------------------------------------------------------------------------
@dataclass
class Batch:
    src: torch.Tensor  # (B, S) left-padded, eos last, as fairseq's translation task
    src_lengths: torch.Tensor
    prev: torch.Tensor  # (B, T) eos then the target shifted right, right-padded
    target: torch.Tensor  # (B, T) right-padded with pad

    def to(self, device):
        return Batch(*(tensor.to(device) for tensor in (self.src, self.src_lengths, self.prev, self.target)))


class Models:
    """Builds models as fairseq-train does (options.parse_args_and_arch + task.build_model) on a
    dictionary-only data directory of its own."""

    def __init__(self, device, quick):
        from fairseq.data import Dictionary

        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
        self.quick = quick
        self.tmp = tempfile.TemporaryDirectory(prefix="gpu_check_")
        dictionary = Dictionary()
        for index in range(60):
            dictionary.add_symbol(f"w{index}")
        for lang in ("src", "tgt"):
            dictionary.save(os.path.join(self.tmp.name, f"dict.{lang}.txt"))
        self.dictionary = dictionary

    @property
    def cuda(self):
        return self.device.type == "cuda"

    def build(self, arch, argv, seed=0, perturb=True):
        """The model on CPU in fp32, train mode; its encoding moved away from identity (seeded) unless
        not `perturb`."""
        from fairseq import options, tasks

        torch.manual_seed(seed)
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, [
            self.tmp.name, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
            "--arch", arch, "--user-dir", USER_DIR, *argv])
        model = tasks.setup_task(args).build_model(args)
        if perturb:
            perturb_away_from_identity(model, seed + 1)
        model.train()
        if hasattr(model, "set_num_updates"):
            model.set_num_updates(0)
        return model

    def batches(self, count, seed, max_src, max_tgt, size):
        """Batches of mixed shapes: each batch's lengths drawn anew, rows of several lengths in it."""
        generator = torch.Generator().manual_seed(seed)
        dictionary = self.dictionary
        low, high, pad, eos = dictionary.nspecial, len(dictionary), dictionary.pad(), dictionary.eos()

        def draw(low_, high_):
            return int(torch.randint(low_, high_ + 1, (1,), generator=generator))

        made = []
        for _ in range(count):
            src_width, tgt_width = draw(3, max_src), draw(2, max_tgt)
            src = torch.full((size, src_width), pad)
            prev = torch.full((size, tgt_width), pad)
            target = torch.full((size, tgt_width), pad)
            src_lengths = torch.empty(size, dtype=torch.long)
            for row in range(size):
                src_len = src_width if row == 0 else draw(2, src_width)
                tgt_len = tgt_width if row == size - 1 else draw(1, tgt_width)
                src[row, src_width - src_len:] = torch.randint(low, high, (src_len,), generator=generator)
                src[row, -1] = eos
                src_lengths[row] = src_len
                tokens = torch.randint(low, high, (tgt_len,), generator=generator)
                tokens[-1] = eos
                target[row, :tgt_len] = tokens
                prev[row, 0] = eos
                prev[row, 1:tgt_len] = tokens[:-1]
            made.append(Batch(src, src_lengths, prev, target))
        return made

    def loss(self, model, batch):
        """Mean token cross-entropy (in at least fp32) and the logits of one forward pass."""
        logits, _ = model(batch.src, batch.src_lengths, batch.prev)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(wide.reshape(-1, wide.size(-1)), batch.target.reshape(-1),
                               ignore_index=self.dictionary.pad(), reduction="sum")
        return loss / batch.target.ne(self.dictionary.pad()).sum(), logits


def perturb_away_from_identity(model, seed):
    """Encodings may start as 'adds nothing' (zero tables, FLOATER's zero last layer): move every
    encoding parameter so that the checks compare the position terms themselves."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.positional_encoding.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))


def step(models, model, batch, loss_scale=1.0):
    """Forward + backward of one batch from zeroed gradients: (loss, logits, {name: gradient in
    float64 on CPU}); gradients unscaled; a trainable parameter without gradient is absent."""
    model.zero_grad(set_to_none=True)
    loss, logits = models.loss(model, batch)
    (loss * loss_scale).backward()
    grads = {name: parameter.grad.detach().double().cpu() / loss_scale
             for name, parameter in model.named_parameters() if parameter.grad is not None}
    return loss.detach().double().cpu(), logits.detach().double().cpu(), grads


def largest(tensor):
    return tensor.abs().max().item() if tensor.numel() else 0.0


def relative(value, reference, floor=0.0):
    """max |value - reference| / max(max |reference|, floor) (0 when both are 0)."""
    value, reference = value.double().cpu(), reference.double().cpu()
    error = largest(value - reference)
    if error == 0.0:
        return 0.0
    scale = max(largest(reference), floor)
    return error / scale if scale > 0 else math.inf


#: a parameter's gradient is compared relative to its largest entry, or to this fraction of the
#: model's largest gradient entry where that is larger: some gradients are zero but for rounding
#: (attention key biases, the last bias of AT5's MLP: softmax ignores a constant added to a row)
GRADIENT_FLOOR = 1e-2


def gradient_errors(grads, reference):
    """{parameter: relative difference of `grads` from `reference`} (`relative`, each floored by
    GRADIENT_FLOOR of the reference's largest entry); a gradient present in one and not the other fails."""
    if sorted(grads) != sorted(reference):
        only = sorted(set(grads) ^ set(reference))
        raise CheckFailed(f"different parameters got gradients: {only[:4]}")
    floor = GRADIENT_FLOOR * max((largest(gradient) for gradient in reference.values()), default=0.0)
    return {name: relative(grads[name], reference[name], floor) for name in reference}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the checks -----------------------------------------------------------------------------------
#: the package's FlexAttention switch (posenc_fairseq/kernels/flex.py), read when a stack starts a pass
FLEX_SWITCH = "POSENC_FLEX_ATTENTION"


@dataclass(frozen=True)
class FusedPath:
    """A fused attention path that an environment switch turns on (read when a stack starts a pass),
    as checks b and t compare it with the reference: `on` is the switch's value for the check's "on"
    ("off" is the reference), `module` the kernels module whose `attend` each call through the path
    takes (counted), `calls_column` its table's column, `options` per encoding, `cpu_backward`:
    whether the CPU runs its backward (else forward only, under no_grad)."""
    name: str
    switch: str
    on: str
    module: str
    calls_column: str
    options: dict
    cpu_backward: bool


#: "train": FlexAttention also where gradients are needed (CUDA), which check b measures before it may
#: become a default
FLEX = FusedPath("FlexAttention", FLEX_SWITCH, "train", "flex", "flex calls", FLEX_OPTIONS, cpu_backward=False)
TRITON = FusedPath("the Triton kernel", "POSENC_TRITON_ATTENTION", "on", "triton_attention", "kernel calls", {},
                   cpu_backward=True)


def set_switch(name, value):
    """The environment variable `name` = value, or unset where value is None."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextmanager
def path_mode(path, mode):
    """`path`'s switch for the check's `mode`: "on" (the path's `on` value) or "off"."""
    previous = os.environ.get(path.switch)
    os.environ[path.switch] = path.on if mode == "on" else mode
    try:
        yield
    finally:
        set_switch(path.switch, previous)


@contextmanager
def counted_calls(path):
    """Counts the calls that take `path` (a silent fallback cannot pass for equality)."""
    import importlib

    module = importlib.import_module(f"posenc_fairseq.kernels.{path.module}")
    calls = [0]
    attend = module.attend

    def counted(*args, **kwargs):
        calls[0] += 1
        return attend(*args, **kwargs)

    module.attend = counted
    try:
        yield calls
    finally:
        module.attend = attend


def dynamo_counts():
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return dict(ok=frames.get("ok", 0), total=frames.get("total", 0),
                graph_breaks=sum(counters["graph_break"].values()))


def relative_cases(first):
    """The encodings with relative terms (a logit or a value term per distance), `first` first."""
    from posenc_fairseq.encodings import ENCODINGS
    from posenc_fairseq.encodings.base import hook_use

    def uses(name):
        use = hook_use(ENCODINGS[name].__new__(ENCODINGS[name]))
        return use.logits or use.values

    return sorted((name for name in ENCODINGS if uses(name)),
                  key=lambda name: (first.index(name) if name in first else len(first), name))


def flex_cases():
    """The encodings with a logit term (FlexAttention reads it as a table per distance)."""
    from posenc_fairseq.encodings import ENCODINGS
    from posenc_fairseq.encodings.base import hook_use

    return [name for name in relative_cases(FLEX_FIRST) if hook_use(ENCODINGS[name].__new__(ENCODINGS[name])).logits]


#: a path passes where it is as close to the float64 result as the reference paths, within this factor
#: (both round, in different orders), or within the row's limit
TRUTH_FACTOR = 4.0


def worst_of(errors):
    """The largest of `errors` (NaN if any is NaN: a NaN must fail, not vanish in max()), 0 if none."""
    errors = list(errors)
    return math.nan if any(error != error for error in errors) else max(errors, default=0.0)


@dataclass
class Comparison:
    """`compare_paths`' result: `differences` {"logits" or a parameter's name: (the path's largest
    relative difference from the float64 result, the reference paths' own)} over the batches compared
    (`done`), the calls that took the path, seconds per mode ("on", "off")."""
    differences: dict
    done: int = 0
    calls: int = 0
    seconds: dict = None

    def _worst(self, which, gradients):
        return worst_of(pair[which] for what, pair in self.differences.items() if (what != "logits") == gradients)

    logits = property(lambda self: self._worst(0, False))
    reference_logits = property(lambda self: self._worst(1, False))
    gradients = property(lambda self: self._worst(0, True))
    reference_gradients = property(lambda self: self._worst(1, True))

    @property
    def worst_parameter(self) -> Optional[str]:
        """The parameter of `gradients`, the largest difference (None without gradients)."""
        parameters = {what: pair[0] for what, pair in self.differences.items() if what != "logits"}
        return max(parameters, key=lambda name: (parameters[name] != parameters[name], parameters[name]),
                   default=None)

    def problems(self, batches, limit=FP32_LIMIT):
        """Why a row of `batches` batches fails: the budget spent before its end, a difference from
        float64 over both `limit` and TRUTH_FACTOR times the reference paths' own."""
        problems = []
        if self.done < batches:
            problems.append(f"time budget spent after {self.done} batches")
        failing = [what for what, (error, reference) in self.differences.items()
                   if not error <= max(limit, TRUTH_FACTOR * reference)]
        if failing:
            problems.append(f"limit {limit:g} (or {TRUTH_FACTOR:g}x the reference paths' difference from float64) "
                            f"exceeded: {', '.join(failing[:3])}")
        return problems


def compare_paths(models, path, model, batches, budget, loss_scale=1.0):
    """Each batch through `model` with `path` "on" and "off", and through a float64 copy of it on the
    reference paths (the truth both are measured from): forward + backward (on the CPU only where the
    path has a backward there; else forward under no_grad). Every "on" pass must take the path and
    no other pass may; the logits must be finite."""
    import copy

    backward = models.cuda or path.cpu_backward
    truth_model = copy.deepcopy(model).double()
    result = Comparison({}, seconds={"on": 0.0, "off": 0.0})
    with counted_calls(path) as calls:
        for index, batch in enumerate(batches):
            if budget.spent():
                break
            results = {}
            for mode in ("on", "off", "truth"):
                calls_before = calls[0]
                start = time.perf_counter()
                with path_mode(path, "on" if mode == "on" else "off"), torch.set_grad_enabled(backward):
                    run_model = truth_model if mode == "truth" else model
                    if backward:
                        results[mode] = step(models, run_model, batch, loss_scale=1.0 if mode == "truth" else loss_scale)
                    else:
                        results[mode] = (None, models.loss(run_model, batch)[1].double().cpu(), {})
                if mode != "truth":
                    result.seconds[mode] += time.perf_counter() - start
                took = calls[0] - calls_before
                if (mode == "on") != (took > 0):
                    raise CheckFailed(f"batch {index}: {took} calls of {path.name} with {path.switch} "
                                      f"{'on' if mode == 'on' else 'off'!r}" + (" (float64)" if mode == "truth" else ""))
            if not torch.isfinite(results["on"][1]).all():
                raise CheckFailed(f"{path.name} gave non-finite logits")
            truth = results["truth"]
            errors = {"logits": (relative(results["on"][1], truth[1]), relative(results["off"][1], truth[1]))}
            if backward:
                on, off = gradient_errors(results["on"][2], truth[2]), gradient_errors(results["off"][2], truth[2])
                errors.update({name: (on[name], off[name]) for name in truth[2]})
            for what, pair in errors.items():
                kept = result.differences.get(what, (0.0, 0.0))
                result.differences[what] = (worst_of([kept[0], pair[0]]), worst_of([kept[1], pair[1]]))
            result.done += 1
        result.calls = calls[0]
    return result


#: the columns of `difference_cells`
DIFFERENCE_COLUMNS = ["max logit rel", "reference logit rel", "max grad rel", "reference grad rel", "worst parameter"]


def difference_cells(compared, backward):
    """A row's DIFFERENCE_COLUMNS: the path's and the reference paths' largest relative differences from
    the float64 result."""
    gradient = (lambda value: fmt(value)) if backward else (lambda value: "no backward on CPU")
    return {"max logit rel": fmt(compared.logits), "reference logit rel": fmt(compared.reference_logits),
            "max grad rel": gradient(compared.gradients), "reference grad rel": gradient(compared.reference_gradients),
            "worst parameter": compared.worst_parameter or "—"}


def check_flex(models, budget):
    """b. FlexAttention ("on") against the reference path ("off"), same model, same batches."""
    import torch._dynamo

    from posenc_fairseq.kernels import flex as flex_attention

    cuda = models.cuda
    columns = ["encoding", "batches", "flex calls", *DIFFERENCE_COLUMNS,
               "compiles", "recompiles", "not compiled", "graph breaks", "flex ms", "reference ms", "flex / reference"]
    table = Table("b", columns)
    count = 2 if models.quick else 20
    max_len = 12 if models.quick else 96
    batches = [batch.to(models.device) for batch in models.batches(count, seed=21, max_src=max_len, max_tgt=max_len,
                                                                    size=3 if models.quick else 8)]
    # quick (the CPU test): one layer, one encoding of each kind of table; FlexAttention's eager CPU
    # path traces every call's score_mod with Dynamo (~0.5 s a call)
    argv = [*(sizes(32, 4, 1) if models.quick else FLEX_SIZES), *NO_DROPOUT]
    cases = [name for name in flex_cases() if name in FLEX_FIRST or not models.quick]
    for name in cases:
        def row(name=name):
            model = models.build(f"transformer_{name}", [*argv, *FLEX_OPTIONS.get(name, [])]).to(models.device)
            if not cuda:
                model.eval()  # FlexAttention's eager CPU path: forward only
            if cuda:
                torch._dynamo.reset()  # each encoding compiles afresh, as in a training run of its own
                flex_attention.compiled_flex_attention.cache_clear()
            before = dynamo_counts()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    compared = compare_paths(models, FLEX, model, batches, budget)
                except CheckFailed as error:
                    raise CheckFailed(f"{error}; warnings: {[str(w.message)[:200] for w in caught][:2]}") from error
            after = dynamo_counts()
            compiled = after["ok"] - before["ok"]
            not_compiled = (after["total"] - before["total"]) - compiled
            done = compared.done
            if cuda:  # the compared pass compiled: time another
                flex_ms, reference_ms = time_modes(models, FLEX, model, batches[:done], budget)
            else:
                flex_ms, reference_ms = (compared.seconds[mode] / done if done else None for mode in ("on", "off"))
            cells = {"batches": f"{done}/{len(batches)}", "flex calls": compared.calls,
                     **difference_cells(compared, cuda),
                     "compiles": compiled, "recompiles": max(compiled - 1, 0), "not compiled": not_compiled,
                     "graph breaks": after["graph_breaks"] - before["graph_breaks"],
                     **time_cells("flex", flex_ms, reference_ms)}
            problems = compared.problems(len(batches))
            if not_compiled:
                problems.append("frames left uncompiled (recompile limit or a failed compile: eager FlexAttention)")
            compile_warnings = [str(w.message)[:200] for w in caught if "flex_attention" in str(w.message)
                                and "without torch.compile" not in str(w.message)]
            if compile_warnings:
                problems.append(compile_warnings[0])
            return cells, "FAIL" if problems else "PASS", "; ".join(problems)
        guarded(table, budget, "encoding", name, row)
    fused_extra_rows(models, budget, table, argv, FLEX)
    table.note = ("compiles: frames Dynamo compiled for the encoding (torch._dynamo.utils.counters, after "
                  "torch._dynamo.reset(); none on CPU, where FlexAttention runs eagerly); not compiled: frames it "
                  "gave up on (recompile limit, failed compile). ms: mean time per batch: CUDA forward + backward "
                  "over the same batches again after the compared (compiling) pass; CPU forward of the compared pass")
    return table


def check_triton(models, budget):
    """t. The Triton kernel ("on") against the other paths ("off", the reference), same model, same batches: every
    encoding with relative terms (quick: one of each kind of term)."""
    cuda = models.cuda
    table = Table("t", ["encoding", "batches", "kernel calls", *DIFFERENCE_COLUMNS,
                        "triton ms", "reference ms", "triton / reference"])
    # CUDA: several of its tiles (32 or 64) per sequence; the interpreter's are 16
    count, max_len, size = (1, 20, 3) if models.quick else (20, 256, 8)
    batches = [batch.to(models.device) for batch in models.batches(count, seed=31, max_src=max_len, max_tgt=max_len,
                                                                    size=size)]
    argv = [*(sizes(32, 4, 1) if models.quick else FLEX_SIZES), *NO_DROPOUT]
    cases = [name for name in relative_cases(TRITON_FIRST) if name in TRITON_FIRST or not models.quick]
    for name in cases:
        def row(name=name):
            model = models.build(f"transformer_{name}", argv).to(models.device)
            compared = compare_paths(models, TRITON, model, batches, budget)
            done = compared.done
            if cuda:  # the compared pass compiled the kernels: time another
                triton_ms, reference_ms = time_modes(models, TRITON, model, batches[:done], budget)
            else:
                triton_ms, reference_ms = (compared.seconds[mode] / done if done else None for mode in ("on", "off"))
            cells = {"batches": f"{done}/{len(batches)}", "kernel calls": compared.calls,
                     **difference_cells(compared, True), **time_cells("triton", triton_ms, reference_ms)}
            problems = compared.problems(len(batches))
            return cells, "FAIL" if problems else "PASS", "; ".join(problems)
        guarded(table, budget, "encoding", name, row)
    fused_extra_rows(models, budget, table, argv, TRITON)
    table.note = ("ms: mean time per batch: CUDA forward + backward over the same batches again after the compared "
                  "(compiling) pass; CPU (Triton's interpreter: not a speed) forward + backward of the compared pass")
    return table


#: checks b and t's extra rows: half-precision models, and a fully padded source row (all keys masked)
FLEX_HALF = [("t5", torch.bfloat16), ("xl", torch.float16)]
FLEX_MASKED = ["alibi", "xl"]


def fused_extra_rows(models, budget, table, argv, path):
    """`path` against the reference in bf16/fp16 models (CUDA only), and with one source row all
    padding, whose queries and cross-attention see no key: uniform weights on both paths."""
    max_len = 24 if models.quick else 48
    batches = [batch.to(models.device) for batch in models.batches(3, seed=23, max_src=max_len, max_tgt=max_len,
                                                                    size=4)]
    src = batches[0].src.clone()
    src[1, :] = models.dictionary.pad()
    masked = [Batch(src, batches[0].src_lengths, batches[0].prev, batches[0].target)]
    cases = [(f"{name}, {str(dtype).split('.')[-1]} model", name, dtype, batches) for name, dtype in FLEX_HALF]
    cases += [(f"{name}, a source row all padding", name, torch.float32, masked) for name in FLEX_MASKED]
    for label, name, dtype, data in cases:
        def row(name=name, dtype=dtype, data=data):
            if dtype != torch.float32 and not models.cuda:
                return {}, "SKIP", f"half-precision models with {path.name}: CUDA only here"
            model = models.build(f"transformer_{name}", [*argv, *path.options.get(name, [])]).to(models.device, dtype)
            if not (models.cuda or path.cpu_backward):
                model.eval()
            scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
            compared = compare_paths(models, path, model, data, budget, loss_scale=scale)
            backward = models.cuda or path.cpu_backward
            cells = {"batches": f"{compared.done}/{len(data)}", path.calls_column: compared.calls,
                     **difference_cells(compared, backward)}
            problems = compared.problems(len(data), FP32_LIMIT if dtype == torch.float32 else HALF_LIMITS[dtype])
            return cells, "FAIL" if problems else "PASS", "; ".join(problems)
        guarded(table, budget, "encoding", label, row)


def fmt_ms(seconds):
    return f"{1000 * seconds:.1f}" if seconds else "—"


def time_cells(name, on_seconds, reference_seconds):
    """The columns "<name> ms", "reference ms" and "<name> / reference" of a row."""
    ratio = f"{on_seconds / reference_seconds:.2f}" if on_seconds and reference_seconds else "—"
    return {f"{name} ms": fmt_ms(on_seconds), "reference ms": fmt_ms(reference_seconds), f"{name} / reference": ratio}


def time_modes(models, path, model, batches, budget):
    """Mean seconds of forward + backward per batch of each mode of `path` over `batches`."""
    if not batches or budget.spent():
        return None, None
    means = []
    for mode in ("on", "off"):
        with path_mode(path, mode):
            synchronize(models.device)
            start = time.perf_counter()
            for batch in batches:
                model.zero_grad(set_to_none=True)
                models.loss(model, batch)[0].backward()
            synchronize(models.device)
            means.append((time.perf_counter() - start) / len(batches))
    return means


def check_floater(models, budget):
    """e. FLOATER's training step (its table solved every step) against sinusoidal's: time, and on CUDA
    the peak memory. (That its table equals the CPU solve is the test suite's: tests/encodings/floater.)"""
    table = Table("e", ["measure", "FLOATER", "reference", "value"])
    dim, layers = (32, 2) if models.quick else (256, 6)
    size_argv = [*sizes(dim, 4, layers, 4 * dim), *NO_DROPOUT]

    def floater_model():
        """FLOATER with dynamics h whose table stays O(1) over a few hundred positions (a random
        perturbation gives h a Jacobian of ~3 at d=256: the table would grow like e^(3t), t up to 25.6)."""
        model = models.build("transformer_floater", size_argv, perturb=False)
        fc2 = model.positional_encoding.dynamics.fc2
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            fc2.weight.copy_(torch.randn(fc2.weight.shape, generator=generator) * 0.05 / math.sqrt(fc2.in_features))
            fc2.bias.copy_(0.1 * torch.randn(fc2.bias.shape, generator=generator))
        return model

    def cost_row():
        batch = models.batches(1, seed=51, max_src=24 if models.quick else 64, max_tgt=24 if models.quick else 64,
                               size=4 if models.quick else 32)[0].to(models.device)
        warm, timed = (1, 2) if models.quick else (2, 5)
        seconds, peak_mb = {}, {}
        for arch in ("transformer_floater", "transformer_sinusoidal"):
            model = (floater_model() if arch == "transformer_floater" else models.build(arch, size_argv)).to(models.device)
            for _ in range(warm):
                step(models, model, batch)
            synchronize(models.device)
            if models.cuda:
                torch.cuda.reset_peak_memory_stats(models.device)
            start = time.perf_counter()
            for _ in range(timed):
                model.zero_grad(set_to_none=True)
                models.loss(model, batch)[0].backward()
            synchronize(models.device)
            seconds[arch] = (time.perf_counter() - start) / timed
            if models.cuda:
                peak_mb[arch] = torch.cuda.max_memory_allocated(models.device) / 2 ** 20
            del model
        floater, sinusoidal = seconds["transformer_floater"], seconds["transformer_sinusoidal"]
        value = f"ratio {floater / sinusoidal:.2f}"
        if models.cuda:
            value += (f"; peak memory {peak_mb['transformer_floater']:.0f} MB vs "
                      f"{peak_mb['transformer_sinusoidal']:.0f} MB")
        return ({"measure": f"training step (forward + backward), {layers}+{layers} layers d={dim}, "
                            f"{tuple(batch.src.shape)} source, {tuple(batch.prev.shape)} target",
                 "FLOATER": f"{1000 * floater:.1f} ms", "reference": f"sinusoidal {1000 * sinusoidal:.1f} ms",
                 "value": value}, "INFO", "")

    guarded(table, budget, "measure", "step time", cost_row)
    return table


RUNNERS = {"b": check_flex, "e": check_floater, "t": check_triton}


# --- main -----------------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", default=",".join(sorted(CHECKS)),
                        help="checks to run, e.g. a,c (default all: " + ",".join(sorted(CHECKS)) + ")")
    parser.add_argument("--budget", default=None,
                        help="seconds per check: one number for all, or e.g. b=300,e=60 (default on CUDA: "
                             + ",".join(f"{key}={value}" for key, value in CUDA_BUDGETS.items()) + ")")
    parser.add_argument("--quick", action="store_true",
                        help="fewer batches and smaller models (the CPU test's run)")
    args = parser.parse_args(argv)
    only = [key for key in args.only.replace(",", " ").split()]
    unknown = [key for key in only if key not in CHECKS]
    if unknown:
        moved = "; a, c, d, f, g are the test suite's now: make test-cuda" if set(unknown) & set(MOVED) else ""
        parser.error(f"--only: unknown checks {unknown}; expected some of {', '.join(sorted(CHECKS))}{moved}")
    args.only = set(only)
    budgets = dict(CUDA_BUDGETS if args.device == "cuda" else CPU_BUDGETS)
    if args.budget:
        for part in args.budget.split(","):
            key, _, seconds = part.rpartition("=")
            try:
                value = float(seconds)
            except ValueError:
                parser.error(f"--budget {args.budget!r}: expected seconds or CHECK=seconds, e.g. b=300")
            for name in ([key] if key else budgets):
                if name not in CHECKS:
                    parser.error(f"--budget: unknown check {name!r}")
                budgets[name] = value
    args.budgets = budgets
    return args


def header(args):
    import fairseq

    from posenc_fairseq.encodings.floater import solver as floater_solver
    from posenc_fairseq.provenance import source_commit

    lines = ["# gpu_check", "", "| | |", "|---|---|"]

    def add(key, value):
        lines.append(f"| {key} | {value} |")

    add("device", args.device)
    if args.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        add("card", f"{torch.cuda.get_device_name(0)}, {properties.total_memory / 2 ** 30:.0f} GiB, "
                    f"compute capability {properties.major}.{properties.minor}")
        add("CUDA (torch build)", torch.version.cuda)
        matmul = torch.backends.cuda.matmul
        add("fp32 matmul", getattr(matmul, "fp32_precision", None) or f"allow_tf32={matmul.allow_tf32}")
    else:
        add("card", "none (CPU run: FlexAttention's forward only, no memory figures)")
    add("torch", torch.__version__)
    add("python", platform.python_version())
    add("fairseq", f"{fairseq.__version__} ({Path(fairseq.__file__).parent})")
    add("posenc_fairseq", source_commit() or "(no git)")
    add("FLOATER compiled solve", "built" if floater_solver.floater_solve is not None else "not built (Python loops)")
    for path, check in ((FLEX, "b"), (TRITON, "t")):
        add(path.switch, f"'off' in every check but {check} (set by the checks)")
    if args.device == "cpu":
        add("TRITON_INTERPRET", f"{os.environ.get('TRITON_INTERPRET')!r} (check t's kernels in Triton's interpreter)")
    add("checks", ", ".join(key for key in RUN_ORDER if key in args.only)
        + ("  (quick)" if args.quick else ""))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    logging.getLogger("posenc_fairseq").setLevel(logging.WARNING)
    if args.device == "cpu":  # (before Triton is first imported: check t's kernels in its interpreter)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import posenc_fairseq  # noqa: F401
    previous = {path.switch: os.environ.get(path.switch) for path in (FLEX, TRITON)}
    for switch in previous:
        os.environ[switch] = "off"  # the reference paths everywhere but in checks b and t
    try:
        return run_checks(args)
    finally:
        for switch, value in previous.items():
            set_switch(switch, value)


def run_checks(args):
    print(header(args), flush=True)
    models = Models(args.device, args.quick)
    summary = []
    for key in RUN_ORDER:
        if key not in args.only:
            continue
        budget = Budget(args.budgets[key])
        print(f"\n## {key}. {CHECKS[key]}\n", flush=True)
        try:
            table = RUNNERS[key](models, budget)
        except Exception as error:  # noqa: BLE001 - e.g. a process group that does not start
            print(f"\n--- check {key}: {type(error).__name__}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            table = Table(key, ["check"])
            table.add("FAIL", short_error(error), check=key)
        finally:
            for path in (FLEX, TRITON):
                os.environ[path.switch] = "off"
        elapsed = budget.elapsed()
        print(table.markdown())
        if table.note:
            print(f"\n{table.note}")
        print(f"\nelapsed {elapsed:.1f} s (budget {budget.seconds:g} s)", flush=True)
        summary.append((key, table, elapsed))
    failed = sum(table.count("FAIL") for _, table, _ in summary)
    print("\n## summary\n")
    print("| check | pass | fail | skip | info | seconds |\n|---|---|---|---|---|---|")
    for key, table, elapsed in summary:
        print(f"| {key}. {CHECKS[key]} | {table.count('PASS')} | {table.count('FAIL')} | {table.count('SKIP')} "
              f"| {table.count('INFO')} | {elapsed:.1f} |")
    print(f"\n{'FAILED: ' + str(failed) + ' rows' if failed else 'all checks passed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
