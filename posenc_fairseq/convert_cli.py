"""File handling and command line of scripts/convert_{transformer,roberta}_checkpoint.py; the
conversion itself is posenc_fairseq.convert (pure functions on the checkpoint dict)."""
import argparse
import filecmp
import os
import shutil
import sys
import tempfile


def build_parser(kind: str) -> argparse.ArgumentParser:
    from .encodings import ENCODINGS

    stock = "transformer (any size variant)" if kind == "transformer" else "RoBERTa (model.pt; base, large, with or without classification heads)"
    parser = argparse.ArgumentParser(
        prog=f"convert_{kind}_checkpoint.py",
        description=f"Convert a stock fairseq {stock} checkpoint into a posenc_fairseq one whose outputs "
                    "equal the source's (the encoding starts as the identity). Further options of the "
                    "encoding (e.g. --floater-method rk4) are passed through to the converted model.")
    parser.add_argument("src", help="stock fairseq checkpoint (never modified)")
    parser.add_argument("dst", help="converted checkpoint to write (atomically; must differ from SRC)")
    parser.add_argument("--encoding", default="floater", metavar="NAME",
                        help="positional encoding (default floater); one of " + ", ".join(sorted(ENCODINGS)))
    parser.add_argument("--no-dict", action="store_true",
                        help="(roberta) do not copy dict.txt from SRC's folder beside DST")
    return parser


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_checkpoint(path: str):
    import torch

    import posenc_fairseq  # noqa: F401  (allow-lists fairseq's config types for torch.load)

    with open(path, "rb") as handle:
        magic = handle.read(2)
    if magic != b"PK" and not magic.startswith(b"\x80"):  # torch.save: zip archive or legacy pickle
        raise ValueError(f"{path} is not a fairseq checkpoint (not a file written by torch.save)")
    try:
        return torch.load(path, map_location="cpu")
    except Exception as error:  # noqa: BLE001  (any unreadable file gets the same clear message)
        lines = str(error).strip().splitlines()
        detail = f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
        raise ValueError(f"{path} is not a fairseq checkpoint (torch.load cannot read it: {detail})")


def save_atomically(state, path: str):
    import torch

    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".convert-", suffix=".pt", dir=folder)
    os.close(handle)
    try:
        torch.save(state, temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def copy_dictionary(src: str, dst: str):
    """RobertaModel.from_pretrained needs dict.txt beside the checkpoint."""
    source = os.path.join(os.path.dirname(os.path.abspath(src)), "dict.txt")
    target = os.path.join(os.path.dirname(os.path.abspath(dst)), "dict.txt")
    if not os.path.isfile(source) or os.path.abspath(source) == os.path.abspath(target):
        return None
    if os.path.exists(target):
        if not filecmp.cmp(source, target, shallow=False):
            print(f"warning: {target} exists and differs from {source}; left unchanged", file=sys.stderr)
        return None
    shutil.copyfile(source, target)
    return target


def main(kind: str, argv=None):
    from .convert import ConversionError, _arch as converted_architecture, check_encoding, convert_checkpoint, parse_overrides

    args, rest = build_parser(kind).parse_known_args(argv)
    try:
        check_encoding(args.encoding)
        overrides = parse_overrides(rest)
        if not os.path.isfile(args.src):
            raise ConversionError(f"{args.src}: no such file")
        if os.path.exists(args.dst) and os.path.samefile(args.src, args.dst) \
                or os.path.realpath(args.src) == os.path.realpath(args.dst):
            raise ConversionError("DST is SRC; refusing to overwrite the source checkpoint")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.dst))):
            raise ConversionError(f"{os.path.dirname(os.path.abspath(args.dst))}: no such folder")
        state = load_checkpoint(args.src)
        converted = convert_checkpoint(state, kind, args.encoding, overrides)
    except (ConversionError, ValueError) as error:
        fail(f"{args.src}: {error}" if not str(error).startswith(args.src) else str(error))
    save_atomically(converted, args.dst)
    print(f"wrote {args.dst} (architecture {converted_architecture(converted)}, outputs equal to the source)")
    if kind == "roberta" and not args.no_dict:
        copied = copy_dictionary(args.src, args.dst)
        if copied:
            print(f"copied dict.txt to {copied}")
    return 0
