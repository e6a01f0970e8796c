#!/usr/bin/env python
"""Binarise IMDB or SNLI for fairseq's sentence_prediction task, the same way
examples/glue/preprocess_glue.py binarises the GLUE tasks (input0[/input1] + label folders, GPT-2 BPE
or `--bpe none` with a given dictionary). The GLUE tasks of the paper's table 1 (SST-2, QNLI, QQP,
MNLI) go through examples/glue/preprocess_glue.py.

  python examples/classification/preprocess.py IMDB aclImdb OUT_DIR [--bpe gpt2|none] [--dict dict.txt]
  python examples/classification/preprocess.py SNLI snli_1.0 OUT_DIR [--bpe gpt2|none] [--dict dict.txt]

IMDB: the aclImdb_v1 folder (train|test/pos|neg/*.txt). There is no dev split: the test reviews are
binarised as `valid` (what fairseq validates on and evaluate.py scores; the paper reports test accuracy).
SNLI: the snli_1.0 folder (snli_1.0_{train,dev,test}.jsonl); pairs without a gold label ('-') are
dropped, as usual; dev -> valid, test -> test (with labels).
"""
import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "glue"))
from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from preprocess_glue import binarize, bpe_encode, built_beside, check_out_dir  # noqa: E402
from roberta_bpe import add_bpe_options, dictionary_for  # noqa: E402
from script_helpers import read_lines  # noqa: E402

# what each task's folder must hold: (IMDB) review folders, (SNLI) JSON-lines files
LAYOUT = {"IMDB": [f"{split}/{label}" for split in ("train", "test") for label in ("neg", "pos")],
          "SNLI": [f"snli_1.0_{split}.jsonl" for split in ("train", "dev", "test")]}


def clean(text: str) -> str:
    return " ".join(text.replace("<br />", " ").split())


def imdb_rows(root: Path, split: str, seed: int = 1):
    rows = []
    for label in ("neg", "pos"):
        for path in sorted((root / split / label).glob("*.txt")):
            rows.append(([clean(path.read_text(encoding="utf-8"))], label))
    random.Random(seed).shuffle(rows)  # the folders are sorted by label
    return rows


def snli_rows(root: Path, split: str):
    rows = []
    for line in read_lines(root / f"snli_1.0_{split}.jsonl"):  # JSON text may hold U+2028: split at line ends only
        if not line.strip():
            continue
        example = json.loads(line)
        if example["gold_label"] == "-":
            continue
        rows.append(([clean(example["sentence1"]), clean(example["sentence2"])], example["gold_label"]))
    return rows


def read_task(task: str, root: Path):
    """{fairseq split name: [(inputs, label)]}"""
    if task == "IMDB":
        return {"train": imdb_rows(root, "train"), "valid": imdb_rows(root, "test")}
    return {"train": snli_rows(root, "train"), "valid": snli_rows(root, "dev"), "test": snli_rows(root, "test")}


def check_layout(task: str, root: Path, fail):
    """fail(message) unless `root` is the task's folder (aclImdb / snli_1.0)."""
    if not root.is_dir():
        fail(f"no folder {root}")
    for part in LAYOUT[task]:
        if not (root / part).exists():
            fail(f"no {part} in {root}: expected the {'aclImdb' if task == 'IMDB' else 'snli_1.0'} folder")


def preprocess(task: str, root: Path, out: Path, args, fail):
    splits = read_task(task, root)
    for split, rows in splits.items():
        if not rows:
            fail(f"no {task} examples for {split} in {root}")
    inputs = len(next(iter(splits.values()))[0][0])
    with built_beside(out) as (build, processed):
        for split, rows in splits.items():
            for i in range(inputs):
                raw = processed / f"{split}.raw.input{i}"
                raw.write_text("".join(row[0][i] + "\n" for row in rows), encoding="utf-8")
                bpe_encode(raw, processed / f"{split}.input{i}", args)
            (processed / f"{split}.label").write_text("".join(row[1] + "\n" for row in rows))
        for i in range(inputs):
            options = ["--only-source", "--trainpref", processed / f"train.input{i}", "--validpref",
                       processed / f"valid.input{i}", "--destdir", build / f"input{i}", "--workers", args.workers,
                       "--srcdict", args.dictionary]
            if "test" in splits:
                options += ["--testpref", processed / f"test.input{i}"]
            binarize(options)
        options = ["--only-source", "--trainpref", processed / "train.label", "--validpref",
                   processed / "valid.label", "--destdir", build / "label", "--workers", args.workers]
        if "test" in splits:
            options += ["--testpref", processed / "test.label"]
        binarize(options)
    print(f"{task}: {', '.join(f'{k} {len(v)}' for k, v in splits.items())} examples binarised into {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=["IMDB", "SNLI"])
    p.add_argument("raw_dir", type=Path, help="aclImdb (IMDB) or snli_1.0 (SNLI)")
    p.add_argument("out_dir", type=Path, help="binarised task folder (e.g. data/IMDB-bin)")
    add_bpe_options(p)
    args = p.parse_args(argv)
    check_layout(args.task, args.raw_dir, p.error)  # before anything is downloaded or written
    check_out_dir(args.out_dir, [args.raw_dir], args, p.error)
    args.dictionary = dictionary_for(p, args)
    preprocess(args.task, args.raw_dir, args.out_dir, args, p.error)


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    main()
