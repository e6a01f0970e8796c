"""examples/extrapolation/'s scripts on hand-made files: make_s2l.py (parallel files line for line,
its output never over its input) and report.py (columns matched by bin name across files)."""
import json
import os

import pytest

from util import REPO, load_script

EXTRAPOLATION = REPO / "examples" / "extrapolation"


@pytest.fixture(scope="module")
def make_s2l():
    return load_script(EXTRAPOLATION / "make_s2l.py")


def write_lines(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def refused(capsys, main, *argv):
    """stderr of main(argv), which must stop with a usage error."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_make_s2l_refuses_parallel_files_of_different_lengths(make_s2l, tmp_path, capsys):
    raw = tmp_path / "raw"
    write_lines(raw / "train.en", ["one", "two", "three", "four"])
    write_lines(raw / "train.de", ["eins", "zwei", "drei"])
    err = refused(capsys, make_s2l.main, raw, tmp_path / "out", "--threshold", "80")
    assert f"{raw / 'train.en'} has 4 lines but {raw / 'train.de'} has 3" in err
    assert not (tmp_path / "out").exists()


def test_make_s2l_splits_lines_at_line_ends_only(make_s2l, tmp_path):
    """U+2028, NEL and form feed inside a sentence (str.splitlines would split there; fairseq's
    readers do not): every pair stays a pair."""
    raw = tmp_path / "raw"
    source = ["a b\u2028c d", "second\x85source", "third\x0csource", "w " * 90]
    target = ["A B C D", "zweite Quelle", "dritte Quelle", "v " * 90]
    write_lines(raw / "train.en", source)
    write_lines(raw / "train.de", target)
    make_s2l.main([str(raw), str(tmp_path / "out"), "--threshold", "80"])

    def pairs(split):
        lines = [(tmp_path / "out" / f"{split}.{lang}").read_text(encoding="utf-8").split("\n")[:-1]
                 for lang in ("en", "de")]
        return list(zip(*lines))
    assert pairs("train") == list(zip(source[:3], target[:3]))
    assert pairs("test") == [(source[3], target[3])]


def test_make_s2l_never_writes_over_its_input(make_s2l, tmp_path, capsys):
    raw = tmp_path / "raw"
    write_lines(raw / "train.en", ["short", " ".join(["w"] * 90)])
    write_lines(raw / "train.de", ["kurz", " ".join(["v"] * 90)])
    before = {path.name: path.read_bytes() for path in raw.iterdir()}
    assert "is RAW_DIR" in refused(capsys, make_s2l.main, raw, raw)
    assert "is RAW_DIR" in refused(capsys, make_s2l.main, raw, tmp_path / "." / "raw")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(raw / "train.de", out / "train.de")  # an output that is an input by another name
    assert "would replace an input" in refused(capsys, make_s2l.main, raw, out)
    assert {path.name: path.read_bytes() for path in raw.iterdir()} == before
    (tmp_path / "file").write_text("")  # OUT_DIR a file: one line (before, FileExistsError's traceback)
    assert "is not a folder this user may write in" in refused(capsys, make_s2l.main, raw, tmp_path / "file")


def test_make_s2l_names_a_missing_input_and_refuses_a_zero_threshold(make_s2l, tmp_path, capsys):
    assert f"no folder {tmp_path / 'nowhere'}" in refused(capsys, make_s2l.main, tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "raw").mkdir()
    assert "no file" in refused(capsys, make_s2l.main, tmp_path / "raw", tmp_path / "out")
    write_lines(tmp_path / "raw" / "train.en", ["a"])
    write_lines(tmp_path / "raw" / "train.de", ["b"])
    assert "must be at least 1" in refused(capsys, make_s2l.main, tmp_path / "raw", tmp_path / "out",
                                           "--threshold", "0")
    assert not (tmp_path / "out").exists()


def bins(edges, scores):
    """evaluate.py --json's bins for lower edges `edges` (the last one open)."""
    return [{"bin": f"[{low},{'inf' if high is None else high})", "low": low, "high": high, "sentences": 5,
             "bleu": score} for low, high, score in zip(edges, edges[1:] + [None], scores)]


def test_report_matches_columns_by_bin_name(tmp_path, capsys):
    (tmp_path / "bleu_a.json").write_text(json.dumps({"bleu": 20.0, "bins": bins([80, 100, 120], [30.0, 20.0, 10.0])}))
    (tmp_path / "bleu_b.json").write_text(json.dumps({"bleu": 21.0, "bins": bins([0, 80, 100], [35.0, 31.0, 21.0])}))
    report = load_script(EXTRAPOLATION / "report.py")
    report.main([str(tmp_path / "bleu_a.json"), str(tmp_path / "bleu_b.json"), "--out", str(tmp_path / "s2l")])
    lines = (tmp_path / "s2l.md").read_text().splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(header, cells)) for cells in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:])}
    assert header == ["encoding", "BLEU [0,80)", "BLEU [80,100)", "BLEU [100,120)", "BLEU [100,inf)",
                      "BLEU [120,inf)", "all"]
    assert rows["a"]["BLEU [0,80)"] == "–" and rows["a"]["BLEU [80,100)"] == "30.00 (n=5)"
    assert rows["b"]["BLEU [0,80)"] == "35.00 (n=5)" and rows["b"]["BLEU [80,100)"] == "31.00 (n=5)"
    assert rows["b"]["BLEU [100,inf)"] == "21.00 (n=5)" and rows["b"]["BLEU [120,inf)"] == "–"
    assert (tmp_path / "s2l.png").stat().st_size > 0
    assert "no file" in refused(capsys, report.main, tmp_path / "bleu_c.json", "--out", tmp_path / "x")
    (tmp_path / "other").mkdir()  # one name twice (two runs' folders): refused, not one row overwriting the other
    (tmp_path / "other" / "bleu_a.json").write_text((tmp_path / "bleu_a.json").read_text())
    assert "two results named a" in refused(capsys, report.main, tmp_path / "bleu_a.json",
                                            tmp_path / "other" / "bleu_a.json", "--out", tmp_path / "x")
    for seed in ("seed1", "seed2"):  # a dotted prefix keeps its last part (with_suffix dropped it: one file for both)
        report.main([str(tmp_path / "bleu_a.json"), "--out", str(tmp_path / f"s2l.{seed}")])
        assert (tmp_path / f"s2l.{seed}.md").exists() and (tmp_path / f"s2l.{seed}.png").exists()
