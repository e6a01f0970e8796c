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
"""
import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from roberta_bpe import add_bpe_options, dictionary_for  # noqa: E402

SPLITS = ["train", "dev", "test-middle", "test-high"]


def binarize(options):
    """fairseq-preprocess, run in this process (same code as the command, without its start-up cost)."""
    from fairseq import options as fairseq_options
    from fairseq_cli.preprocess import main as preprocess

    preprocess(fairseq_options.get_preprocessing_parser().parse_args([str(o) for o in options]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("race_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    add_bpe_options(p)
    args = p.parse_args(argv)
    dictionary = dictionary_for(p, args)

    extracted = args.out_dir / "extracted"
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
                  "--destdir", args.out_dir / f"input{i}", "--workers", args.workers, "--srcdict", dictionary])
    label = args.out_dir / "label"
    shutil.rmtree(label, ignore_errors=True)
    label.mkdir(parents=True)
    for split, name in zip(SPLITS, ["train", "valid", "test", "test1"]):
        shutil.copyfile(extracted / f"{split}.label", label / f"{name}.label")
    print(f"RACE binarised into {args.out_dir} (test = middle, test1 = high)")


if __name__ == "__main__":
    main()
