"""scripts/floater_solve_cost.py: the products' GFLOP it counts against the hidden-space solve's forward
written out by hand, its per-interval split against a direct count, and the goals' arithmetic."""
import pytest

from util import REPO, load_script

cost = load_script(REPO / "scripts" / "floater_solve_cost.py")
TINY = ["--rows", "3", "--dim", "4", "--hidden", "6", "--substeps", "2", "--sample", "2"]


def forward_flops_per_interval(rows, dim, hidden, substeps, stages):
    """The forward's products per interval: z = W1_b b and b's update once; per step, each stage's
    combination of the earlier ones (1 x i by i x N h), its product with M, and the steps' sums of z and
    of the relu outputs (1 x stages by stages x N h each)."""
    per_step = sum(2 * i * rows * hidden for i in range(1, stages))
    per_step += stages * 2 * rows * hidden * hidden + 2 * (2 * stages * rows * hidden)
    return 2 * rows * dim * hidden + substeps * per_step + 2 * rows * hidden * dim


@pytest.mark.parametrize("method, stages", [("rk4", 4), ("midpoint", 2), ("euler", 1)])
def test_the_forward_products_are_the_hand_count(method, stages):
    (_, _), (gflop, once) = cost.costs(cost.parse_args([*TINY, "--method", method]))["forward"]
    assert gflop * 1e9 == pytest.approx(forward_flops_per_interval(3, 4, 6, 2, stages), rel=1e-12)
    assert once == pytest.approx(0, abs=1e-15)  # every product is an interval's


def test_per_interval_and_once_add_up_to_a_counted_solve():
    args = cost.parse_args(TINY)
    parts, direct = cost.costs(args), cost.counted(args, 5)
    for name, ((kernels, kernels_once), (gflop, gflop_once)) in parts.items():
        assert kernels * 5 + kernels_once == direct[name][0], name
        assert gflop * 5 + gflop_once == pytest.approx(direct[name][1], rel=1e-12), name
    # recomputing an interval runs the forward's kernels but b's update (2), and the reductions that the
    # kept backward makes once per solve run per interval (2): as many kernels as the forward
    recomputed, kept = parts["backward, each interval recomputed"][0][0], parts["backward, stages kept"][0][0]
    assert recomputed == kept + parts["forward"][0][0]


def test_the_goals_arithmetic(capsys):
    assert cost.main([*TINY, "--positions", "11", "--step-ms", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(10 intervals)" in lines[0]
    goals = [line for line in lines if line.startswith("stages ")]
    assert len(goals) == 4
    assert "solved every 1, step <= 1.5x: solve in <= 10.0 ms" in goals[0]  # (1.5 - 1) x 1 x 20 ms
    assert "solved every 10, step <= 1.1x: solve in <= 20.0 ms" in goals[1]  # (1.1 - 1) x 10 x 20 ms


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        cost.parse_args(["--positions", "1"])
