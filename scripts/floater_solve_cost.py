#!/usr/bin/env python
"""What one FLOATER training solve costs, counted (not timed): the kernels and the matrix products' GFLOP
of the hidden-space loops (loops.py, which the CUDA graphs capture), forward and backward, for a model's
rows, width and length. Counted on `--sample` intervals and scaled: every interval runs the same
operations. With --step-ms (a measured step of the reference model), the rates a solve must sustain for
FLOATER's step to stay within 1.5x (solved every update) and 1.1x (every 10) of it (issue 36's goals).

    python scripts/floater_solve_cost.py                      # base size: 54 rows, d = hidden = 512, 512 positions
    python scripts/floater_solve_cost.py --step-ms 49.6       # and what the goals ask

A kernel here is an operator that is neither a view nor an allocation: on CUDA each launches (at least)
one kernel. docs/floater.md holds the base size's table.
"""
import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posenc_fairseq.encodings.floater import loops  # noqa: E402
from posenc_fairseq.encodings.floater.solver import TABLEAUS  # noqa: E402

ALLOCATIONS = {"aten::empty", "aten::new_empty", "aten::empty_like", "aten::empty_strided"}
PRODUCTS = {"aten::addmm": (1, 2), "aten::addmm_": (1, 2), "aten::mm": (0, 1)}


class Cost(TorchDispatchMode):
    """Kernels (operators that are neither views nor allocations) and the GFLOP of the matrix products run."""

    def __init__(self):
        super().__init__()
        self.kernels = collections.Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not func.is_view and name not in ALLOCATIONS and name != "aten::detach":
            self.kernels[name] += 1
        if name in PRODUCTS:
            first, second = (args[index] for index in PRODUCTS[name])
            self.flops += 2 * first.size(0) * first.size(1) * second.size(1)
        return func(*args, **(kwargs or {}))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=54, help="slots solved together (base size, 6+6 layers: 54)")
    parser.add_argument("--dim", type=int, default=512, help="the model's width d")
    parser.add_argument("--hidden", type=int, default=512, help="h's hidden width (--floater-hidden; default d)")
    parser.add_argument("--positions", type=int, default=512, help="positions solved: intervals = positions - 1")
    parser.add_argument("--substeps", type=int, default=5, help="steps per interval (Delta / step size)")
    parser.add_argument("--method", choices=sorted(TABLEAUS), default="rk4")
    parser.add_argument("--sample", type=int, default=4, help="intervals counted (then scaled)")
    parser.add_argument("--step-ms", type=float, help="a measured step of the reference model, in ms")
    args = parser.parse_args(argv)
    if min(args.rows, args.dim, args.hidden, args.substeps, args.sample) < 1 or args.positions < 2:
        parser.error("--rows, --dim, --hidden, --substeps and --sample must be >= 1, --positions >= 2")
    return args


def counted(args, intervals: int) -> dict:
    """{part: (kernels, GFLOP)} of a solve over `intervals` for the forward, the backward recomputing
    each interval, and the backward with the stages kept."""
    generator = torch.Generator().manual_seed(0)
    y0 = torch.randn(args.rows, args.dim, generator=generator) * 0.1
    w1 = torch.randn(args.hidden, args.dim + 1, generator=generator) * 0.02
    w2 = torch.randn(args.dim, args.hidden + 1, generator=generator) * 0.02
    run = loops._HiddenRun(TABLEAUS[args.method], 0, intervals, 0.1, args.substeps, loops.computed_now, y0, w1,
                           torch.zeros(args.hidden), w2, torch.zeros(args.dim))
    parts = {}
    with Cost() as cost:
        states, _ = loops._hidden_forward_loops(run, y0, False)
    parts["forward"] = cost
    grad = torch.randn_like(states)
    with Cost() as cost:
        loops._hidden_backward_loops(run, states, grad, None)
    parts["backward, each interval recomputed"] = cost
    _, relus = loops._hidden_forward_loops(run, y0, True)
    with Cost() as cost:
        loops._hidden_backward_loops(run, states, grad, relus)
    parts["backward, stages kept"] = cost
    return {name: (sum(cost.kernels.values()), cost.flops / 1e9) for name, cost in parts.items()}


def costs(args) -> dict:
    """{part: ((kernels per interval, once per solve), (GFLOP per interval, once per solve))}: the
    difference between `--sample` and twice as many intervals is what each interval adds."""
    once, twice = counted(args, args.sample), counted(args, 2 * args.sample)
    result = {}
    for name in once:
        per = [(twice[name][i] - once[name][i]) / args.sample for i in range(2)]
        result[name] = tuple((per[i], once[name][i] - per[i] * args.sample) for i in range(2))
    return result


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    intervals = args.positions - 1
    parts = costs(args)
    totals = {name: tuple(per * intervals + fixed for per, fixed in part) for name, part in parts.items()}
    print(f"{args.rows} rows, d {args.dim}, hidden {args.hidden}, {args.positions} positions ({intervals} intervals), "
          f"{args.method} with {args.substeps} steps per interval")
    print("| part | kernels per interval | kernels | GFLOP per interval | GFLOP |")
    print("|---|---|---|---|---|")
    for name, ((kernels, _), (gflop, _)) in parts.items():
        print(f"| {name} | {kernels:g} | {totals[name][0]:,.0f} | {gflop:.4f} | {totals[name][1]:,.1f} |")
    if args.step_ms is None:
        return 0
    forward = totals["forward"]
    for label, backward in (("recomputed", totals["backward, each interval recomputed"]),
                            ("kept", totals["backward, stages kept"])):
        kernels, gflop = forward[0] + backward[0], forward[1] + backward[1]
        for every, ratio in ((1, 1.5), (10, 1.1)):
            budget_ms = (ratio - 1) * every * args.step_ms  # one solve per window of `every` steps
            print(f"stages {label}, solved every {every}, step <= {ratio}x: solve in <= {budget_ms:.1f} ms: "
                  f"{gflop / budget_ms:.1f} TFLOPS, <= {1000 * budget_ms / kernels:.2f} us per kernel")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
