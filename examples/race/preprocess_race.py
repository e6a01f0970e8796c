#!/usr/bin/env python
"""Binarise RACE for fairseq's sentence_ranking task, following fairseq's examples/roberta/
preprocess_RACE.py + preprocess_RACE.sh, with the BPE selectable and the output a parameter.

  python examples/race/preprocess_race.py RACE_DIR OUT_DIR [--bpe gpt2|none] [--dict dict.txt]

RACE_DIR is the extracted RACE.tar.gz (RACE_DIR/{train,dev,test}/{middle,high}/*.txt, one JSON
document each). Step 1 runs fairseq's own preprocess_RACE.py (installed with fairseq) to write
OUT_DIR/extracted/{train,dev,test-middle,test-high}.input0..4 (context; the 4 question+option
texts) and .label; step 2 BPE-encodes (gpt2: fairseq's multiprocessing_bpe_encoder with
encoder.json/vocab.bpe/dict.txt, downloaded into --bpe-dir if missing; none: as is, with --dict);
step 3 runs fairseq-preprocess into OUT_DIR/input0..4 and copies the labels into OUT_DIR/label
(train, valid = dev, test = test-middle, test1 = test-high).
OUT_DIR is built in a temporary folder beside it and replaces an earlier one only when complete (as
examples/glue/preprocess_glue.py does); one that is or holds RACE_DIR, --dict or --bpe-dir is refused.
"""
import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "glue"))
from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from preprocess_glue import binarize, built_beside, check_out_dir  # noqa: E402
from roberta_bpe import add_bpe_options, dictionary_for  # noqa: E402

SPLITS = ["train", "dev", "test-middle", "test-high"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("race_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    add_bpe_options(p)
    args = p.parse_args(argv)
    check_out_dir(args.out_dir, [args.race_dir], args, p.error)  # before anything is downloaded or written
    dictionary = dictionary_for(p, args)
    # built beside OUT_DIR, which it replaces only when complete: a failed run leaves no half-built OUT_DIR
    with built_beside(args.out_dir) as (build, _):
        binarize_race(args, dictionary, build)
    print(f"RACE binarised into {args.out_dir} (test = middle, test1 = high)")


def binarize_race(args, dictionary, build: Path):
    """RACE_DIR -> OUT_DIR's content, written into `build`."""
    extracted = build / "extracted"
    subprocess.run([sys.executable, "-m", "fairseq.examples.roberta.preprocess_RACE",
                    "--input-dir", str(args.race_dir), "--output-dir", str(extracted)], check=True)
    for split in SPLITS:
        for i in range(5):
            raw, out = extracted / f"{split}.input{i}", extracted / f"{split}.input{i}.bpe"
            if args.bpe == "none":
                shutil.copyfile(raw, out)
            else:
                subprocess.run([sys.executable, "-m", "fairseq.examples.roberta.multiprocessing_bpe_encoder",
                                "--encoder-json", str(args.bpe_dir / "encoder.json"),
                                "--vocab-bpe", str(args.bpe_dir / "vocab.bpe"), "--inputs", str(raw),
                                "--outputs", str(out), "--workers", str(args.workers), "--keep-empty"], check=True)
    for i in range(5):
        binarize(["--only-source", "--trainpref", extracted / f"train.input{i}.bpe",
                  "--validpref", extracted / f"dev.input{i}.bpe",
                  "--testpref", f"{extracted}/test-middle.input{i}.bpe,{extracted}/test-high.input{i}.bpe",
                  "--destdir", build / f"input{i}", "--workers", args.workers, "--srcdict", dictionary])
    label = build / "label"
    label.mkdir()
    for split, name in zip(SPLITS, ["train", "valid", "test", "test1"]):
        shutil.copyfile(extracted / f"{split}.label", label / f"{name}.label")


if __name__ == "__main__":
    end_on_terminate()  # (here, not in main: the tests call main in their own process)
    main()
