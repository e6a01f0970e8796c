#!/usr/bin/env python
"""The main job on bundled toy data (what `make demo` runs).

1. generate a deterministic toy parallel corpus (posenc_fairseq.toy_data),
2. train a sentencepiece model with its Python API and encode the corpus,
3. binarise with fairseq-preprocess,
4. train a small transformer with `fairseq-train --user-dir posenc_fairseq --arch ARCH`,
5. translate the test set with fairseq-generate (sentencepiece removed) and print sacrebleu BLEU.

Everything is written under work/demo/ (git-ignored). Usage: run_demo.py [--arch A] [--max-update N]
"""
import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import sentencepiece

from posenc_fairseq.toy_data import parallel_corpus, write_parallel

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*command, log):
    command = [str(part) for part in command]
    command[0] = str(BIN / command[0])
    print("$", " ".join(command), flush=True)
    with open(log, "a") as out:
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="transformer_floater")
    parser.add_argument("--max-update", type=int, default=1200)
    parser.add_argument("--workdir", type=Path, default=REPO / "work" / "demo")
    args = parser.parse_args()
    started = time.time()
    work = args.workdir
    log = work / "demo.log"
    for sub in ("raw", "spm", "bin", "checkpoints"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    log.write_text("")

    raw = write_parallel(work / "raw", {
        "train": parallel_corpus(4000, seed=1), "valid": parallel_corpus(100, seed=3),
        "test": parallel_corpus(200, seed=4)})
    sentencepiece.SentencePieceTrainer.train(
        input=[str(raw / "train.src"), str(raw / "train.tgt")], model_prefix=str(work / "spm" / "spm"),
        vocab_size=120, character_coverage=1.0, model_type="unigram", minloglevel=2)
    spm = sentencepiece.SentencePieceProcessor(model_file=str(work / "spm" / "spm.model"))
    for split in ("train", "valid", "test"):
        for lang in ("src", "tgt"):
            lines = (raw / f"{split}.{lang}").read_text().splitlines()
            pieces = spm.encode(lines, out_type=str)
            (work / "spm" / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in pieces))

    run("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", work / "spm" / "train", "--validpref", work / "spm" / "valid",
        "--testpref", work / "spm" / "test", "--destdir", work / "bin", "--joined-dictionary",
        "--workers", "2", log=log)
    run("fairseq-train", work / "bin", "--user-dir", REPO / "posenc_fairseq", "--arch", args.arch,
        "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
        "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings",
        "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "2e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "200", "--criterion",
        "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "4096",
        "--max-update", args.max_update, "--save-dir", work / "checkpoints", "--no-epoch-checkpoints",
        "--cpu", "--seed", "1", "--log-format", "simple", "--log-interval", "100", log=log)
    hypotheses = work / "generate.txt"
    run("fairseq-generate", work / "bin", "--user-dir", REPO / "posenc_fairseq",
        "--path", work / "checkpoints" / "checkpoint_last.pt", "--beam", "4", "--cpu",
        "--bpe", "sentencepiece", "--sentencepiece-model", work / "spm" / "spm.model",
        "--scoring", "sacrebleu", "--batch-size", "100", log=hypotheses)
    score = re.findall(r"BLEU = ([0-9.]+)", hypotheses.read_text())[-1]
    print(f"arch {args.arch}: test BLEU (sacrebleu) = {score}  [{time.time() - started:.0f} s]")


if __name__ == "__main__":
    main()
