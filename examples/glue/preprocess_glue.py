#!/usr/bin/env python
"""Binarise a GLUE task for fairseq's sentence_prediction task, following fairseq's
examples/roberta/preprocess_GLUE_tasks.sh (same columns, header handling, QQP filtering, MNLI dev
sets, STS-B labels divided by 5), with two changes: the BPE is selectable and the output directory
is a parameter.

  python examples/glue/preprocess_glue.py GLUE_DIR TASK OUT_DIR [--bpe gpt2|none] [--dict dict.txt]

GLUE_DIR is the folder written by download_glue_data.py (GLUE_DIR/TASK/{train,dev,test}.tsv;
MNLI: dev_matched/dev_mismatched/test_matched/test_mismatched). TASK: CoLA SST-2 MRPC QQP STS-B MNLI
QNLI RTE, a comma-separated list of them, or ALL (OUT_DIR then gets one TASK-bin folder per task).
--bpe gpt2 (RoBERTa's; default): encoder.json, vocab.bpe and dict.txt are downloaded into
--bpe-dir if missing, text is encoded with fairseq's multiprocessing_bpe_encoder.
--bpe none: text is used as it is (whitespace tokens) with --dict (the tests' plain dictionary).
Each OUT_DIR (TASK-bin) is built in a temporary folder beside it (with the intermediate text files)
and replaces an earlier one only when complete; GLUE_DIR is only read. An OUT_DIR that is or holds
what the run reads (GLUE_DIR/TASK, --dict, --bpe-dir) is refused: replacing it would delete them.
"""
import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from roberta_bpe import add_bpe_options, dictionary_for  # noqa: E402
from script_helpers import check_output_folder  # noqa: E402

TASKS = ["CoLA", "SST-2", "MRPC", "QQP", "STS-B", "MNLI", "QNLI", "RTE"]
# 1-based columns as in preprocess_GLUE_tasks.sh: (train/dev inputs, test inputs, label, dev label)
COLUMNS = {
    "QQP": ((4, 5), (2, 3), 6, 6),
    "MNLI": ((9, 10), (9, 10), 12, 16),
    "QNLI": ((2, 3), (2, 3), 4, 4),
    "MRPC": ((4, 5), (4, 5), 1, 1),
    "RTE": ((2, 3), (2, 3), 4, 4),
    "STS-B": ((8, 9), (8, 9), 10, 10),
    "SST-2": ((1,), (2,), 2, 2),
    "CoLA": ((4,), (2,), 2, 2),
}


def splits_of(task):
    if task == "MNLI":
        return ["train", "dev_matched", "dev_mismatched", "test_matched", "test_mismatched"]
    return ["train", "dev", "test"]


def check_task_folder(glue_dir: Path, task: str, fail):
    """fail(message) unless GLUE_DIR/TASK holds the task's train and dev files."""
    data = glue_dir / task
    if not data.is_dir():
        fail(f"no folder {data} (GLUE_DIR/TASK as download_glue_data.py writes it)")
    dev = [split for split in splits_of(task) if split.startswith("dev")]
    for needed in (["train"], dev):
        if not any((data / f"{split}.tsv").is_file() for split in needed):
            fail(f"no {' or '.join(f'{split}.tsv' for split in needed)} in {data}")


def check_out_dir(out: Path, data_inputs, args, fail):
    """fail(message) if `out`, which built_beside replaces whole, is or holds what the run reads: the
    data (`data_inputs`) or the dictionary and BPE files of args (before anything is downloaded)."""
    bpe_inputs = [args.bpe_dir] if args.bpe == "gpt2" else [args.dict] if args.dict else []
    check_output_folder(out, [*data_inputs, *bpe_inputs], fail)


@contextlib.contextmanager
def built_beside(out: Path):
    """(build, scratch): two empty folders inside a temporary folder beside `out`, to build `out` in
    and to keep intermediate files in. When the block ends, the build folder replaces `out`: an earlier
    `out` is kept until the new one is complete, and kept as it was if the block fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        build, scratch, old = work / "new", work / "processed", work / "old"
        build.mkdir()
        scratch.mkdir()
        yield build, scratch
        if out.exists() or out.is_symlink():
            os.replace(out, old)
        try:
            os.replace(build, out)
        except BaseException:
            if old.exists() or old.is_symlink():
                os.replace(old, out)  # the earlier one back
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def read_rows(task, tsv: Path, split: str):
    lines = tsv.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not (task == "CoLA" and split != "test"):  # CoLA train/dev have no header
        lines = lines[1:]
    rows = [line.split("\t") for line in lines]
    if task == "QQP" and split != "test":  # drop malformed lines
        rows = [row for row in rows if len(row) == 6]
    return rows


def bpe_encode(raw: Path, out: Path, args):
    if args.bpe == "none":
        shutil.copyfile(raw, out)
        return
    subprocess.run([sys.executable, "-m", "fairseq.examples.roberta.multiprocessing_bpe_encoder",
                    "--encoder-json", str(args.bpe_dir / "encoder.json"), "--vocab-bpe", str(args.bpe_dir / "vocab.bpe"),
                    "--inputs", str(raw), "--outputs", str(out), "--workers", str(args.workers), "--keep-empty"],
                   check=True)


def binarize(options):
    """fairseq-preprocess, run in this process (same code as the command, without its start-up cost)."""
    from fairseq import options as fairseq_options
    from fairseq_cli.preprocess import main as preprocess

    preprocess(fairseq_options.get_preprocessing_parser().parse_args([str(o) for o in options]))


def preprocess_task(task, glue_dir: Path, out: Path, args):
    with built_beside(out) as (build, processed):
        binarize_task(task, glue_dir / task, build, processed, args)
    print(f"{task}: binarised into {out}")


def binarize_task(task, data: Path, out: Path, processed: Path, args):
    """GLUE_DIR/TASK (`data`) -> the binarised task in `out`, its text files on the way in `processed`."""
    inputs, test_inputs, label_column, dev_label_column = COLUMNS[task]
    splits = [s for s in splits_of(task) if (data / f"{s}.tsv").exists()]
    for split in splits:
        rows = read_rows(task, data / f"{split}.tsv", split)
        columns = test_inputs if split.startswith("test") else inputs
        for i, column in enumerate(columns):
            raw = processed / f"{split}.raw.input{i}"
            raw.write_text("".join(row[column - 1] + "\n" for row in rows), encoding="utf-8")
            bpe_encode(raw, processed / f"{split}.input{i}", args)
        if not split.startswith("test"):
            column = dev_label_column if (task == "MNLI" and split != "train") else label_column
            (processed / f"{split}.label").write_text("".join(row[column - 1] + "\n" for row in rows))

    dev = [s for s in splits if s.startswith("dev")]
    test = [s for s in splits if s.startswith("test")]
    dictionary = args.dictionary
    for i in range(len(inputs)):
        options = ["--only-source", "--trainpref", processed / f"train.input{i}",
                   "--validpref", ",".join(str(processed / f"{s}.input{i}") for s in dev),
                   "--destdir", out / f"input{i}", "--workers", args.workers, "--srcdict", dictionary]
        if test:
            options += ["--testpref", ",".join(str(processed / f"{s}.input{i}") for s in test)]
        binarize(options)
    if task != "STS-B":
        binarize(["--only-source", "--trainpref", processed / "train.label",
                  "--validpref", ",".join(str(processed / f"{s}.label") for s in dev),
                  "--destdir", out / "label", "--workers", args.workers])
    else:  # regression target scaled to [0, 1]
        (out / "label").mkdir(parents=True)
        for split, name in (("train", "train"), ("dev", "valid")):
            values = (processed / f"{split}.label").read_text().split()
            (out / "label" / f"{name}.label").write_text("".join(f"{float(v) / 5.0}\n" for v in values))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("glue_dir", type=Path)
    p.add_argument("task", help="one of " + " ".join(TASKS) + ", a comma-separated list of them, or ALL")
    p.add_argument("out_dir", type=Path,
                   help="the binarised task for one task; for a list or ALL, the parent of TASK-bin folders")
    add_bpe_options(p)
    args = p.parse_args(argv)
    tasks = TASKS if args.task == "ALL" else args.task.split(",")
    for task in tasks:  # every task checked before anything is downloaded or written
        if task not in TASKS:
            p.error(f"unknown task {task}")
        check_task_folder(args.glue_dir, task, p.error)
    one = len(tasks) == 1 and args.task != "ALL"
    outs = {task: args.out_dir if one else args.out_dir / f"{task}-bin" for task in tasks}
    folders = [args.glue_dir / task for task in tasks]
    for out in outs.values():  # (each against every task's folder: an earlier task's would go before it is read)
        check_out_dir(out, folders, args, p.error)
    args.dictionary = dictionary_for(p, args)
    for task in tasks:
        preprocess_task(task, args.glue_dir, outs[task], args)


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    main()
