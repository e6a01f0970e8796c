#!/usr/bin/env python
"""Sentencepiece (Python API) + fairseq-preprocess for a raw parallel corpus.

RAW_DIR holds train.SRC, train.TGT, valid.*, test.* (plain, untokenised text, one sentence per
line; get_wmt14_en_de.sh / get_iwslt14_de_en.sh write that layout). Lines end at line ends only, as
fairseq-preprocess reads them (a U+2028 or form feed inside a sentence stays in it), and the two
sides of each split must have as many lines (checked before anything is written). A DEST that holds
an earlier preparation (spm.model, spm/ or bin/) is refused: writing over it would leave a
sentencepiece model and text that the binarised data do not match. A preparation that fails or is
interrupted (Ctrl-C, SIGTERM) removes what it wrote; one killed outright (SIGKILL) cannot, and lacks
the stamp a finished one ends with, so the refusal then says that DEST may be incomplete. Writes:
  DEST/spm.model, DEST/spm.vocab      joint sentencepiece model (trained on train.SRC + train.TGT)
  DEST/spm/{split}.{lang}             encoded text
  DEST/bin/                           fairseq-preprocess output (--joined-dictionary)
  DEST/prepare.done                   written last: the preparation finished (with its options)
"""
import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from script_helpers import at_least, check_parallel, fairseq_command, read_lines  # noqa: E402


#: written last into DEST: its presence tells a finished preparation from one killed midway
STAMP = "prepare.done"
#: what a preparation writes into DEST
OUTPUTS = ("spm.model", "spm.vocab", "spm", "bin", STAMP)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw_dir", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--vocab-size", type=at_least(1), default=32000, help="joint vocabulary (paper WMT14: 32k)")
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe", "word", "char"])
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--input-sentence-size", type=int, default=10_000_000,
                   help="sentences sampled to train sentencepiece")
    p.add_argument("--splits", default="train,valid,test")
    p.add_argument("--workers", type=at_least(1), default=8)
    args = p.parse_args(argv)
    if not args.raw_dir.is_dir():
        p.error(f"no folder {args.raw_dir}")
    unknown = sorted(set(args.splits.split(",")) - {"train", "valid", "test"})
    if unknown:  # (fairseq-preprocess takes these three; another name would be dropped without a word)
        p.error(f"--splits {args.splits}: unknown split {', '.join(unknown)} (train, valid, test)")
    splits = [s for s in args.splits.split(",") if (args.raw_dir / f"{s}.{args.src}").exists()
              or (args.raw_dir / f"{s}.{args.tgt}").exists()]
    # every split checked before anything is written (train too: sentencepiece is trained on it)
    for split in dict.fromkeys(["train"] + splits):
        check_parallel(args.raw_dir / f"{split}.{args.src}", args.raw_dir / f"{split}.{args.tgt}", p.error)

    earlier = [name for name in OUTPUTS if (args.dest / name).exists()]
    if earlier:
        unfinished = "" if (args.dest / STAMP).exists() else f" that may be incomplete (no {STAMP}, which is written last)"
        p.error(f"{args.dest} holds an earlier preparation ({', '.join(earlier)}){unfinished}: remove it or choose "
                "another DEST")
    if args.dest.exists() and not args.dest.is_dir():
        p.error(f"{args.dest} is not a folder: give a folder as DEST")
    created_dest = not args.dest.exists()
    try:
        args.dest.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # (under a file, or no permission)
        p.error(f"cannot make {args.dest}: {error.strerror or error}")
    try:
        prepare(args, splits)
    except BaseException as error:  # (Ctrl-C too) nothing half-written is left to block the next run
        for name in OUTPUTS:
            path = args.dest / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if created_dest:
            args.dest.rmdir()
        if isinstance(error, KeyboardInterrupt):
            raise SystemExit(f"interrupted; nothing kept in {args.dest}")
        reason = failure(error)
        if reason is None:  # (a bug: its traceback)
            raise
        raise SystemExit(f"error: {reason}; nothing kept in {args.dest}") from None


def failure(error: BaseException):
    """What went wrong, in words, for the failures a preparation may meet; None for others."""
    if isinstance(error, subprocess.CalledProcessError):
        return f"fairseq-preprocess failed (exit status {error.returncode})"
    if isinstance(error, SentencepieceFailed):
        return str(error)
    if isinstance(error, OSError):  # (disk full, no permission; fairseq-preprocess not found)
        return f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    return None


class SentencepieceFailed(Exception):
    """sentencepiece's training failed, in words (it raises a RuntimeError of its C++ status)."""


def prepare(args, splits):
    """sentencepiece trained on train, every split encoded, then binarised (into args.dest)."""
    prefix = args.dest / "spm"
    try:
        spm.SentencePieceTrainer.train(
            input=[str(args.raw_dir / f"train.{args.src}"), str(args.raw_dir / f"train.{args.tgt}")],
            model_prefix=str(prefix), vocab_size=args.vocab_size, model_type=args.model_type,
            character_coverage=args.character_coverage, input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True, hard_vocab_limit=False, minloglevel=2)
    except RuntimeError as error:  # (e.g. empty training files)
        raise SentencepieceFailed(f"sentencepiece training on train.{args.src}, train.{args.tgt} failed: "
                                  f"{str(error).strip()}") from None
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")

    encoded = args.dest / "spm"
    encoded.mkdir(exist_ok=True)
    for split in splits:
        for lang in (args.src, args.tgt):
            lines = read_lines(args.raw_dir / f"{split}.{lang}")
            with open(encoded / f"{split}.{lang}", "w", encoding="utf-8") as out:
                for piece in sp.encode(lines, out_type=str):
                    out.write(" ".join(piece) + "\n")

    command = [fairseq_command("fairseq-preprocess"),
               "--source-lang", args.src, "--target-lang", args.tgt,
               "--destdir", str(args.dest / "bin"), "--joined-dictionary", "--workers", str(args.workers)]
    for split, flag in (("train", "--trainpref"), ("valid", "--validpref"), ("test", "--testpref")):
        if split in splits:
            command += [flag, str(encoded / split)]
    subprocess.run(command, check=True)
    (args.dest / STAMP).write_text("".join(f"{key} {value}\n" for key, value in vars(args).items()), encoding="utf-8")
    print(f"binarised data in {args.dest / 'bin'}; sentencepiece model {prefix}.model")


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    main()
