#!/usr/bin/env python
"""The main job on bundled toy data (what `make demo` runs).

1. generate a deterministic toy parallel corpus (posenc_fairseq.toy_data),
2. train a sentencepiece model with its Python API and encode the corpus,
3. binarise with fairseq-preprocess,
4. train a small transformer with `fairseq-train --user-dir posenc_fairseq --arch ARCH`,
5. translate the test set with fairseq-generate (sentencepiece removed) and print sacrebleu BLEU.

Layout under --workdir (default work/demo/, git-ignored):
    data/             corpus, sentencepiece model and binarised data; made once, reused by every run
    ARCH/             one folder per architecture: checkpoints/, train.log, generate.txt
A run starts ARCH's training afresh (its old checkpoints are removed); other architectures'
folders are left alone, so several encodings can be compared side by side.

fairseq's progress (one line per --log-interval updates and per epoch) is shown in the terminal;
the full output is in ARCH/train.log. Threads are set deliberately (--threads, default 1: on a
busy machine more threads than free cores make every update many times slower).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
DATA_VERSION = "toy-v1 train=4000 valid=100 test=200 spm=120"

# The demo's model and training settings (scripts/compare.py --preset demo uses them too).
TRAIN_OPTIONS = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
    "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings",
    "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "3e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100", "--criterion",
    "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "4096",
    "--no-epoch-checkpoints", "--validate-interval", "5", "--num-workers", "0", "--seed", "1",
    "--log-format", "simple",
]
# FLOATER solves its ODE over the batch's positions; the demo uses the paper's caching (solve
# every K updates, reuse the detached table in between) so its time is close to the others'.
ARCH_OPTIONS = {"floater": ["--floater-recompute-every", "10"]}


def refuse_unusable_device(parser, args):
    """--device/--fp16/--bf16 (args) that cannot run here end in one parser error."""
    if (args.fp16 or args.bf16) and args.device != "cuda":
        parser.error("--fp16/--bf16 need --device cuda (fairseq trains in fp32 on CPU)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA GPU (a CPU build of torch, or no GPU)")

def arch_options(arch: str):
    """The demo's extra options of one architecture (its encoding's entry in ARCH_OPTIONS)."""
    name = arch.split("_", 1)[1] if "_" in arch else arch
    for encoding, options in ARCH_OPTIONS.items():
        if name == encoding or name.startswith(encoding + "_"):
            return list(options)
    return []


class CommandFailed(RuntimeError):
    pass



def train_progress(line: str):
    """The terminal's short form of fairseq-train's progress lines (None: log only)."""
    fields = dict(re.findall(r"(\w+)[= ]([0-9.e+-]+)(?:,| \||$)", line))
    if "| train_inner |" in line:
        epoch = int(re.search(r"epoch (\d+)", line).group(1))
        return (f"update {fields.get('num_updates', '?'):>5}  epoch {epoch:>3}  "
                f"train loss {fields.get('loss', '?'):>6}  ppl {fields.get('ppl', '?'):>7}  lr {fields.get('lr', '?')}  "
                f"[{fields.get('wall', '?')} s]")
    if "| valid |" in line:
        return (f"update {fields.get('num_updates', '?'):>5}  valid loss {fields.get('loss', '?'):>6}  "
                f"ppl {fields.get('ppl', '?'):>7}")
    if "num. shared model params" in line or "done training" in line:
        return line.split(" | ")[-1].strip()
    return None


def generate_progress(line: str):
    found = re.search(r"Translated \d+ sentences.*", line)
    return found.group(0) if found else None


def command_line(*command):
    command = [str(part) for part in command]
    if (BIN / command[0]).exists():
        command[0] = str(BIN / command[0])
    return command


def run(command, log, show=None, env=None):
    """Run `command`, appending its output to `log`; print `show(line)` of each line as they come
    (where it is not None). On failure print the end of the output and raise CommandFailed."""
    print("$", " ".join(command), flush=True)
    tail = []
    with open(log, "a") as out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                 text=True, env=env, bufsize=1) as process:
        try:
            for line in process.stdout:
                out.write(line)
                tail = (tail + [line])[-40:]
                shown = show(line) if show is not None else None
                if shown:
                    print("  " + shown, flush=True)
        except BaseException:
            # stopped (Ctrl-C, or SIGTERM to this process alone: scripts/compare.py's end_on_terminate):
            # the command stops too (Popen's exit would leave it running)
            process.terminate()
            raise
    if process.returncode != 0:
        sys.stderr.write("".join(tail))
        raise CommandFailed(f"{Path(command[0]).name} failed (exit {process.returncode}); full output in {log}")


def prepare_data(data: Path, env) -> Path:
    """Corpus -> sentencepiece -> fairseq-preprocess, once: reused while DATA_VERSION matches."""
    stamp = data / "READY"
    if stamp.exists() and stamp.read_text() == DATA_VERSION and (data / "bin" / "dict.src.txt").exists():
        print(f"data: reusing {data}", flush=True)
        return data / "bin"
    import sentencepiece

    from posenc_fairseq.toy_data import parallel_corpus, write_parallel

    print(f"data: toy corpus, sentencepiece and fairseq-preprocess into {data} (once)", flush=True)
    if data.exists():
        shutil.rmtree(data)  # partial or older data: fairseq-preprocess refuses existing dictionaries
    (data / "spm").mkdir(parents=True)
    raw = write_parallel(data / "raw", {
        "train": parallel_corpus(4000, seed=1), "valid": parallel_corpus(100, seed=3),
        "test": parallel_corpus(200, seed=4)})
    sentencepiece.SentencePieceTrainer.train(
        input=[str(raw / "train.src"), str(raw / "train.tgt")], model_prefix=str(data / "spm" / "spm"),
        vocab_size=120, character_coverage=1.0, model_type="unigram", minloglevel=2)
    spm = sentencepiece.SentencePieceProcessor(model_file=str(data / "spm" / "spm.model"))
    for split in ("train", "valid", "test"):
        for lang in ("src", "tgt"):
            lines = (raw / f"{split}.{lang}").read_text().splitlines()
            pieces = spm.encode(lines, out_type=str)
            (data / "spm" / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in pieces))
    run(command_line("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
                     "--trainpref", data / "spm" / "train", "--validpref", data / "spm" / "valid",
                     "--testpref", data / "spm" / "test", "--destdir", data / "bin", "--joined-dictionary",
                     "--workers", "1"), data / "preprocess.log", env=env)
    stamp.write_text(DATA_VERSION)
    return data / "bin"


def main():
    try:
        demo()
    except CommandFailed as error:
        sys.exit(f"error: {error}")


def demo():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="transformer_floater", help="any transformer_* architecture (default %(default)s)")
    parser.add_argument("--max-update", type=int, default=500, help="training updates (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=REPO / "work" / "demo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="mixed precision (with --device cuda)")
    precision.add_argument("--bf16", action="store_true", help="bfloat16 (with --device cuda)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of each fairseq command (OMP_NUM_THREADS; default %(default)s)")
    parser.add_argument("--log-interval", type=int, default=50, help="updates between progress lines")
    args = parser.parse_args()
    refuse_unusable_device(parser, args)
    if not args.arch.startswith("transformer_"):
        parser.error("the demo translates: choose a transformer_* architecture")
    started = time.time()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    device = ["--cpu"] if args.device == "cpu" else []
    device += ["--fp16"] if args.fp16 else ["--bf16"] if args.bf16 else []

    data_bin = prepare_data(args.workdir / "data", env)
    data_spm = args.workdir / "data" / "spm" / "spm.model"
    work = args.workdir / args.arch
    if (work / "checkpoints").exists():
        shutil.rmtree(work / "checkpoints")  # a fresh run (fairseq would otherwise resume from it)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "train.log"
    log.write_text("")
    print(f"training {args.arch} for {args.max_update} updates on {args.device} "
          f"({args.threads} thread{'s' if args.threads > 1 else ''}); full log: {log}", flush=True)
    run(command_line(
        "fairseq-train", data_bin, "--user-dir", REPO / "posenc_fairseq", "--arch", args.arch,
        *TRAIN_OPTIONS, *arch_options(args.arch), "--max-update", args.max_update,
        "--save-dir", work / "checkpoints", "--log-interval", args.log_interval, *device),
        log, show=train_progress, env=env)
    hypotheses = work / "generate.txt"
    hypotheses.write_text("")
    run(command_line(
        "fairseq-generate", data_bin, "--user-dir", REPO / "posenc_fairseq",
        "--path", work / "checkpoints" / "checkpoint_last.pt", "--beam", "4", "--max-len-a", "1", "--max-len-b", "20",
        "--bpe", "sentencepiece",
        "--sentencepiece-model", data_spm, "--scoring", "sacrebleu", "--batch-size", "100", *device),
        hypotheses, show=generate_progress, env=env)
    score = re.findall(r"BLEU = ([0-9.]+)", hypotheses.read_text())[-1]
    print(f"arch {args.arch}: test BLEU (sacrebleu) = {score}  [{time.time() - started:.0f} s]")
    print(f"translations: {hypotheses}; checkpoint: {work / 'checkpoints' / 'checkpoint_last.pt'}")


if __name__ == "__main__":
    main()
