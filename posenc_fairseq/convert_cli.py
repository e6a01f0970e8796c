"""File handling and command line of scripts/convert_{transformer,roberta,transformer_lm}_checkpoint.py, and
of `python -m posenc_fairseq.convert_cli KIND ...` (the same, where only the package is installed); the
conversion itself is posenc_fairseq.convert (pure functions on the checkpoint dict).

File safety: SRC is only read; DST is never an existing file unless --force is given, and never
an existing file in SRC's folder (not even with --force); a missing DST folder is created; DST is
written to a temporary file beside it and moved into place only when complete, with the mode the
umask gives new files (an overwritten file keeps its mode); every OS error (DST a folder, no
permission, disk full ...) ends in one `error:` line, exit status 2, no partial file and no
folder left behind that the run created."""
import argparse
import contextlib
import errno
import filecmp
import os
import shlex
import stat
import sys
import tempfile
from typing import Optional


def build_parser(kind: str, prog: Optional[str] = None) -> argparse.ArgumentParser:
    from .encodings import ENCODINGS

    stock = {"transformer": "transformer (any size variant)",
             "transformer_lm": "transformer_lm language model (any size variant)",
             }.get(kind, "RoBERTa (model.pt; base, large, with or without classification heads)")
    parser = argparse.ArgumentParser(
        prog=prog or f"convert_{kind}_checkpoint.py",
        description=f"Convert a stock fairseq {stock} checkpoint into a posenc_fairseq one whose outputs "
                    "equal the source's (the encoding starts as the identity). Further options of the "
                    "encoding (e.g. --floater-method rk4) are passed through to the converted model.")
    parser.add_argument("src", help="stock fairseq checkpoint (never modified)")
    parser.add_argument("dst", help="converted checkpoint file to write (atomically; its folder is created if "
                                    "missing; an existing file is replaced only with --force, never SRC or a file "
                                    "in SRC's folder)")
    parser.add_argument("--force", action="store_true",
                        help="replace DST if it exists (never SRC, and never a file in SRC's folder)")
    parser.add_argument("--encoding", default="floater", metavar="NAME",
                        help="positional encoding (default floater); one of " + ", ".join(sorted(ENCODINGS)))
    parser.add_argument("--no-dict", action="store_true",
                        help="(roberta) do not copy dict.txt from SRC's folder beside DST")
    return parser


class CLIError(Exception):
    """A problem with the command's files; the message is the one line printed."""


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def os_errors(action: str, path: str):
    """Turn an OSError into CLIError('cannot ACTION PATH: reason')."""
    try:
        yield
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise CLIError(f"cannot {action} {path}: {reason}") from None


def new_file_mode() -> int:
    """The mode `open(path, 'w')` gives a new file under the current umask: read from /proc where it
    can be (setting the umask to read it would, for that moment, change it for every thread)."""
    try:
        with open("/proc/self/status") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def load_checkpoint(path: str):
    import torch

    # (importing the package allow-lists fairseq's config types for torch.load)
    from posenc_fairseq.compat.checkpoint_loading import written_by_torch_save

    with os_errors("read", path):
        readable = written_by_torch_save(path)
    if not readable:
        raise ValueError(f"{path} is not a fairseq checkpoint (not a file written by torch.save)")
    try:
        return torch.load(path, map_location="cpu")
    except OSError as error:
        raise CLIError(f"cannot read {path}: {error.strerror or error}") from None
    except Exception as error:  # noqa: BLE001  (any unreadable file gets the same clear message)
        lines = str(error).strip().splitlines()
        detail = f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
        raise ValueError(f"{path} is not a fairseq checkpoint (torch.load cannot read it: {detail})")


def _same_file(first: str, second: str) -> bool:
    if os.path.realpath(first) == os.path.realpath(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def missing_folders(folder: str):
    """The folders to create (outermost first) so that `folder` exists; CLIError where a
    component exists but is not a folder."""
    missing = []
    current = os.path.abspath(folder)
    while not os.path.isdir(current):
        if os.path.lexists(current):
            raise CLIError(f"cannot create folder {folder}: {current} exists and is not a folder")
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return list(reversed(missing))


def check_paths(kind: str, src: str, dst: str, force: bool):
    """Every check on SRC and DST that can be made before converting (the slow part)."""
    if not os.path.lexists(src):
        raise CLIError(f"{src}: no such file")
    if os.path.isdir(src):
        raise CLIError(f"{src} is a folder; give the checkpoint file (e.g. {os.path.join(src, 'model.pt')})")
    if dst.endswith(("/", os.sep)) or os.path.isdir(dst):
        raise CLIError(f"DST {dst} is a folder; give the file to write (e.g. {os.path.join(dst, 'model.pt')})")
    if _same_file(src, dst):
        raise CLIError("DST is SRC; refusing to overwrite the source checkpoint")
    if kind == "roberta" and os.path.basename(dst) == "dict.txt":
        raise CLIError(f"DST {dst} would be the dictionary copied beside it; name the checkpoint e.g. model.pt")
    if os.path.lexists(dst):
        if not os.path.isfile(dst):
            raise CLIError(f"DST {dst} exists and is not a regular file; refusing to replace it")
        source_folders = {os.path.dirname(os.path.abspath(src)), os.path.dirname(os.path.realpath(src))}  # (SRC a link)
        if any(_same_file(folder, os.path.dirname(os.path.abspath(dst))) for folder in source_folders):
            raise CLIError(f"DST {dst} is an existing file in SRC's folder; refusing to overwrite files beside "
                           "the source (not even with --force): choose another DST")
        if not force:
            raise CLIError(f"DST {dst} exists; refusing to overwrite it (use --force to replace it)")
    folders = missing_folders(os.path.dirname(os.path.abspath(dst)))
    existing = os.path.dirname(folders[0]) if folders else os.path.dirname(os.path.abspath(dst))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"cannot write in folder {existing}: Permission denied")


class _RecordingFile:
    """File object for torch.save that keeps the OSError of a failed write: torch reports a
    failed write as an unspecific RuntimeError, the OSError says why (e.g. disk full)."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data):
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self):
        try:
            return self.handle.flush()
        except OSError as error:
            self.error = error
            raise


def _open_temporary(folder: str):
    """(handle, path) of a new temporary file in `folder` (the tests replace this)."""
    descriptor, path = tempfile.mkstemp(prefix=".convert-", suffix=".tmp", dir=folder)
    return os.fdopen(descriptor, "wb"), path


def _install(temporary: str, path: str, replace: bool):
    """Move the complete temporary file to `path`; without `replace` never over an existing file
    (a link fails if one appeared meanwhile)."""
    if replace:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise CLIError(f"DST {path} appeared while converting; refusing to overwrite it (use --force)") from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(path):  # no hard links on this file system: check, then rename
            raise CLIError(f"DST {path} appeared while converting; refusing to overwrite it (use --force)") from None
        os.rename(temporary, path)
        return
    os.remove(temporary)


def write_file(path: str, write, replace: bool):
    """Write a file atomically: `write(handle)` into a temporary file in the same folder, fsync,
    set the mode (an existing file's own, else the umask's), then move it into place. Nothing is
    left behind on failure."""
    folder = os.path.dirname(os.path.abspath(path))
    mode = stat.S_IMODE(os.stat(path).st_mode) if replace and os.path.isfile(path) else new_file_mode()
    temporary = None
    try:
        with os_errors("write", path):
            handle, temporary = _open_temporary(folder)
            recorder = _RecordingFile(handle)
            with handle:
                try:
                    write(recorder)
                except Exception:
                    if recorder.error is not None:
                        raise recorder.error from None
                    raise
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, mode)
            _install(temporary, path, replace)
            temporary = None
    finally:
        if temporary is not None and os.path.lexists(temporary):
            os.remove(temporary)


def save_checkpoint(state, path: str, replace: bool):
    import torch

    write_file(path, lambda handle: torch.save(state, handle), replace)


def copy_dictionary(src: str, dst: str):
    """RobertaModel.from_pretrained needs dict.txt beside the checkpoint: copy SRC's (never over
    an existing one, never into SRC's folder). Returns the path written or None."""
    source = os.path.join(os.path.dirname(os.path.abspath(src)), "dict.txt")
    target = os.path.join(os.path.dirname(os.path.abspath(dst)), "dict.txt")
    if not os.path.isfile(source) or _same_file(os.path.dirname(source), os.path.dirname(target)):
        return None
    if os.path.lexists(target):
        if not os.path.isfile(target) or not filecmp.cmp(source, target, shallow=False):
            print(f"warning: {target} exists and differs from {source}; left unchanged", file=sys.stderr)
        return None
    with os_errors("read", source):
        with open(source, "rb") as handle:
            data = handle.read()
    write_file(target, lambda handle: handle.write(data), replace=False)
    return target


def remove_created(paths):
    """Undo: remove files written and (empty) folders created by this run, innermost first."""
    for path in reversed(paths):
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.remove(path)


def main(kind: str, argv=None, prog: Optional[str] = None):
    from .convert import (ConversionError, architecture_of, check_encoding, command_line, convert_checkpoint,
                          source_model_options, split_overrides)

    # the encoding's options first, wherever they stand: argparse cannot tell that an option it does not
    # know takes a value, so `--t5-num-buckets 64 SRC DST` would read 64 as SRC
    try:
        overrides, rest = split_overrides(sys.argv[1:] if argv is None else argv)
    except ConversionError as error:
        fail(str(error))
    args, unknown = build_parser(kind, prog).parse_known_args(rest)
    created = []
    try:
        check_encoding(args.encoding)
        if unknown:
            named = [part for part in unknown if part.startswith("-")]
            raise CLIError(f"unknown options: {' '.join(named)}" if named else f"unexpected arguments: {' '.join(unknown)}")
        check_paths(kind, args.src, args.dst, args.force)
        state = load_checkpoint(args.src)
        converted = convert_checkpoint(state, kind, args.encoding, overrides)
        # only now touch the file system: folders, then the checkpoint, then the dictionary
        for folder in missing_folders(os.path.dirname(os.path.abspath(args.dst))):
            with os_errors("create folder", folder):
                os.mkdir(folder)
            created.append(folder)
        replacing = os.path.lexists(args.dst)
        save_checkpoint(converted, args.dst, replace=args.force)
        if not replacing:
            created.append(os.path.abspath(args.dst))
        copied = copy_dictionary(args.src, args.dst) if kind == "roberta" and not args.no_dict else None
    except (ConversionError, CLIError, ValueError) as error:
        remove_created(created)
        message = str(error)
        fail(message if isinstance(error, CLIError) or message.startswith(args.src) else f"{args.src}: {message}")
    except KeyboardInterrupt:
        remove_created(created)
        fail("interrupted; nothing written")
    except Exception as error:  # noqa: BLE001  (one line, not a traceback; POSENC_DEBUG=1 shows it)
        remove_created(created)
        if os.environ.get("POSENC_DEBUG"):
            raise
        lines = str(error).strip().splitlines()
        fail(f"{args.src}: conversion failed: {type(error).__name__}: {lines[0][:300] if lines else ''} "
             "(set POSENC_DEBUG=1 for the traceback)")
    init = overrides.get("floater_init")  # applied after the check (convert_checkpoint)
    equal = ("outputs equal to the source" if init in (None, "zero") else
             f"outputs equal to the source before --floater-init {init} moved the dynamics off zero")
    architecture = architecture_of(converted)
    print(f"wrote {args.dst} (architecture {architecture}, {equal})")
    # fairseq-train builds a model for --restore-file / --finetune-from-model from its command line
    options = {key: value for key, value in {"input_positions": "stock", **overrides}.items() if key != "positional_encoding"}
    given = [*source_model_options(converted, kind), *command_line(options)]
    print(f"to train from it, give fairseq-train: --arch {architecture} {' '.join(shlex.quote(part) for part in given)}")
    if copied:
        print(f"copied dict.txt to {copied}")
    return 0


#: convert.KINDS, the kinds of checkpoint, each with its script (scripts/convert_KIND_checkpoint.py) that
#: runs `main`; written out here so that --help and usage errors need not import torch (a test keeps the two equal)
KINDS = ("transformer", "roberta", "transformer_lm")


def module_main(argv) -> int:
    """`python -m posenc_fairseq.convert_cli KIND SRC DST [options]`: a script's conversion where only the
    package is installed (a wheel has no scripts/)."""
    usage = (f"python -m posenc_fairseq.convert_cli {{{','.join(KINDS)}}} SRC DST [options] (KIND --help for "
             "its options; the same as scripts/convert_KIND_checkpoint.py SRC DST [options])")
    if argv and argv[0] in KINDS:
        from .cli_signals import end_on_terminate

        end_on_terminate()
        return main(argv[0], argv[1:], prog=f"python -m posenc_fairseq.convert_cli {argv[0]}")
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {usage}")
        return 0
    fail(f"the kind of checkpoint comes first ({', '.join(KINDS)}), not {argv[0]!r}: {usage}" if argv else
         f"the kind of checkpoint comes first: {usage}")


if __name__ == "__main__":
    sys.exit(module_main(sys.argv[1:]))
