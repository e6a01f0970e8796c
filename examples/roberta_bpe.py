"""Options and files shared by the RoBERTa recipes' preprocessing (GLUE, RACE): GPT-2 BPE as the
official RoBERTa release uses it, or `--bpe none` with a given dictionary (the tests' plain one)."""
import urllib.request
from pathlib import Path

GPT2_FILES = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/"


def add_bpe_options(parser):
    parser.add_argument("--bpe", choices=["gpt2", "none"], default="gpt2")
    parser.add_argument("--bpe-dir", type=Path, default=Path("gpt2_bpe"))
    parser.add_argument("--dict", type=Path, help="fairseq dictionary for --bpe none")
    parser.add_argument("--workers", type=int, default=8)


def dictionary_for(parser, args) -> Path:
    """The fairseq dictionary to binarise with; downloads the GPT-2 BPE files when needed."""
    if args.bpe == "gpt2":
        args.bpe_dir.mkdir(parents=True, exist_ok=True)
        for name in ("encoder.json", "vocab.bpe", "dict.txt"):
            if not (args.bpe_dir / name).exists():
                urllib.request.urlretrieve(GPT2_FILES + name, args.bpe_dir / name)
        return args.bpe_dir / "dict.txt"
    if args.dict is None:
        parser.error("--bpe none needs --dict")
    if not args.dict.is_file():
        parser.error(f"no dictionary file {args.dict}")
    return args.dict
