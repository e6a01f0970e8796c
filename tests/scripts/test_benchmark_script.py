"""scripts/benchmark.py on a tiny model: the table (with the beam-search column) and --growth."""
import importlib.util
import json
import subprocess
import sys
import types

import pytest

from util import REPO, run

TINY = ["--repeats", "1", "--steps", "1", "--dim", "16", "--heads", "2", "--layers", "1", "--threads", "1",
        "--vocab", "50"]


def load_benchmark():
    """scripts/benchmark.py as a module (its functions, without running it)."""
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def test_table_has_the_beam_search_column():
    out = run([sys.executable, REPO / "scripts" / "benchmark.py", "--archs", "transformer_xl", "--length", "12",
               "--batch", "1", "--gen-length", "4", *TINY])
    header = [line for line in out.splitlines() if line.startswith("arch")][0]
    # (CPU: malloc's heap peak of a step; no RSS column, whose high-water mark measures no step)
    assert header.split()[1:] == ["train", "tok/s", "ratio", "gen", "tok/s", "ratio",
                                  "beam5", "tok/s", "ratio", "heap", "MB", "ratio"]
    rows = [line.split() for line in out.splitlines() if line.startswith("transformer_")]
    assert [row[0] for row in rows] == ["transformer_sinusoidal", "transformer_xl"] and all(len(row) == 13 for row in rows)


def test_growth_prints_an_exponent_per_arch():
    out = run([sys.executable, REPO / "scripts" / "benchmark.py", "--growth", "--growth-lengths", "8", "32",
               "--archs", "transformer_alibi", *TINY, "--extra", "--dropout", "0.2"])
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("transformer_")}
    assert sorted(rows) == ["transformer_alibi", "transformer_sinusoidal"]
    # arch, s/step short, s/step long, exponent [range], difference to the reference's [range]
    assert rows["transformer_sinusoidal"][5] == "+0.00" and all(len(row) == 7 for row in rows.values())
    for row in rows.values():
        float(row[3])  # the median exponent
    float(rows["transformer_alibi"][5])  # its difference, from the ratios within each process


@pytest.mark.parametrize("option", ["--gen-repeats", "--steps", "--copies"])
@pytest.mark.parametrize("value", ["0", "-3", "nan", "1e9x"])
def test_bad_counts_are_refused_in_one_line(option, value):
    done = subprocess.run([sys.executable, REPO / "scripts" / "benchmark.py", option, value],
                          capture_output=True, text=True)
    expected = "must be at least 1" if value.lstrip("-").isdigit() else "invalid int value"
    assert done.returncode == 2 and f"argument {option}: {expected}" in done.stderr


@pytest.mark.parametrize("argv,bound", [
    (["--length", "-8"], 1), (["--length", "0"], 1), (["--batch", "0"], 1), (["--dim", "0"], 1), (["--heads", "0"], 1),
    (["--layers", "0"], 1), (["--vocab", "4"], 5), (["--warmup", "-1"], 0), (["--gen-length", "0"], 1),
    (["--threads", "0"], 1), (["--repeats", "0"], 1), (["--beam", "-1"], 0), (["--growth-lengths", "0", "8"], 1)])
def test_sizes_below_their_bound_are_refused_in_one_line(argv, bound):
    """Before, --length -8 printed a measuring process's traceback and a row of dashes, and exited 0."""
    # (a tiny run otherwise, the bad option last: where it were accepted, the test would end soon)
    done = subprocess.run([sys.executable, REPO / "scripts" / "benchmark.py", *TINY, "--archs", "transformer_sinusoidal",
                           "--length", "12", "--batch", "1", "--gen-length", "4", "--beam", "0", *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].endswith(f"argument {argv[0]}: must be at least {bound}, got {argv[1]}")
    assert done.stdout == "" and "Traceback" not in done.stderr


def test_unknown_architectures_are_refused_before_measuring(monkeypatch, capsys):
    """Before, an architecture fairseq does not know got a row of dashes and exit status 0."""
    benchmark = load_benchmark()
    commands = []
    monkeypatch.setattr(benchmark.subprocess, "run", recording_run(commands, {}))
    for growth in ([], ["--growth"]):
        monkeypatch.setattr(sys, "argv", ["benchmark.py", *growth, "--archs", "transformer_t55", "transformer_xl",
                                          "--reference", "transformer_sinusodal"])
        with pytest.raises(SystemExit) as exit_info:
            benchmark.main()
        assert exit_info.value.code == 2 and commands == []  # no measuring process started
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == ("benchmark.py: error: unknown architecture(s): transformer_sinusodal, "
                                        "transformer_t55 (not fairseq's, nor this package's)")


@pytest.mark.parametrize("growth", [False, True])
def test_a_failed_measurement_prints_the_rest_and_exits_non_zero(monkeypatch, capsys, growth):
    """Before, a measuring process that failed left its row as dashes and the script exited 0."""
    benchmark = load_benchmark()
    result = {"train_tokens_per_s": 1.0, "generate_tokens_per_s": 1.0, "heap_peak_mb": 1.0,
              "train_seconds_per_step": 1.0, "reference_train_seconds_per_step": 1.0}

    def run(command, **kwargs):
        if command[command.index("--one") + 1] == "transformer_xl":
            return types.SimpleNamespace(returncode=1, stdout="", stderr="Traceback ...\nRuntimeError: broken\n")
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(result), stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["benchmark.py", *(["--growth"] if growth else []), "--archs", "transformer_alibi",
                                      "transformer_xl", "--repeats", "2", "--beam", "0"])
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main()
    out, err = capsys.readouterr()
    assert exit_info.value.code == "error: 2 measurement(s) failed (transformer_xl); their errors are printed above"
    assert "RuntimeError: broken" in err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("transformer_")}
    assert sorted(rows) == ["transformer_alibi", "transformer_sinusoidal", "transformer_xl"]
    assert set(rows["transformer_xl"]) == {"-"} and "-" not in rows["transformer_alibi"]


def test_alternating_medians_alternates_which_run_goes_first(monkeypatch):
    benchmark = load_benchmark()
    clock, calls = [0.0], []

    def fake_run(name, seconds):
        def run():
            calls.append(name)
            clock[0] += seconds
        return run

    # a fake clock that only the runs advance: each run's median is exactly its own duration
    monkeypatch.setattr(benchmark, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    medians = benchmark.alternating_medians({"arch": fake_run("arch", 1.0), "reference": fake_run("reference", 3.0)},
                                            4, sync=lambda: None)
    untimed, timed = calls[:2], calls[2:]
    assert untimed == ["arch", "reference"]
    assert timed == ["arch", "reference", "reference", "arch", "arch", "reference", "reference", "arch"]
    assert medians == {"arch": 1.0, "reference": 3.0}


def test_copies_are_built_interleaved_and_timed_as_a_geometric_mean():
    benchmark = load_benchmark()
    assert benchmark.build_order("a", "r", 2, False) == [("a", 0), ("r", 0), ("r", 1), ("a", 1)]
    assert benchmark.build_order("a", "r", 3, True) == [("r", 0), ("a", 0), ("a", 1), ("r", 1), ("r", 2), ("a", 2)]
    assert benchmark.build_order("r", "r", 2, True) == [("r", 0), ("r", 1)]
    means = benchmark.over_copies({("", 0): 1.0, ("reference_", 0): 2.0, ("", 1): 4.0, ("reference_", 1): 8.0})
    assert means == pytest.approx({"": 2.0, "reference_": 4.0})


def recording_run(commands: list, result: dict):
    """A subprocess.run for benchmark.py's measuring processes: records each command and answers `result`."""
    def run(command, **kwargs):
        commands.append(command)
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(result), stderr="")
    return run


def test_odd_rounds_build_the_reference_first(monkeypatch, capsys):
    """The model a process builds first measured slower than the same model built second, so the
    rounds alternate which of the two each measuring process builds first."""
    benchmark = load_benchmark()
    commands = []

    monkeypatch.setattr(benchmark.subprocess, "run", recording_run(commands, {
        "train_tokens_per_s": 1.0, "generate_tokens_per_s": 1.0, "heap_peak_mb": 1.0}))
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--archs", "transformer_t5", "--reference", "transformer",
                                      "--repeats", "4", "--beam", "0"])
    benchmark.main()
    arch_commands = [command for command in commands if command[command.index("--one") + 1] == "transformer_t5"]
    assert ["--reference-first" in command for command in arch_commands] == [False, True, False, True]
    assert "transformer_t5" in capsys.readouterr().out


def test_growth_measures_against_the_given_reference(monkeypatch, capsys):
    """Each --growth process times its arch beside --reference, with --copies copies."""
    benchmark = load_benchmark()
    commands = []

    monkeypatch.setattr(benchmark.subprocess, "run", recording_run(commands, {
        "train_seconds_per_step": 1.0, "reference_train_seconds_per_step": 1.0}))
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--growth", "--archs", "transformer_t5", "--reference",
                                      "transformer_alibi", "--copies", "1", "--repeats", "1"])
    benchmark.main()
    assert len(commands) == 4  # (reference, t5) x (short, long)
    for command in commands:
        assert command[command.index("--reference") + 1] == "transformer_alibi", command
        assert command[command.index("--copies") + 1] == "1", command
    assert "transformer_alibi" in capsys.readouterr().out
