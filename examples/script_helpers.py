"""Helpers the example scripts share: option types that refuse out-of-range numbers at parse time,
reading text files line by line as fairseq does, parallel files checked to match line for line,
inputs and outputs checked before the work (a checkpoint is one, an output never replaces an input,
an output folder never holds one), and writing a file whole or not at all."""
import argparse
import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path


def at_least(minimum: int):
    """An argparse `type`: an integer >= minimum, else a usage error naming the bound."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"  # what argparse names in its message
    return parse


def read_lines(path: Path) -> list:
    """The lines of a UTF-8 text file as fairseq-preprocess and sentencepiece read them: split at line
    ends only (\\n, \\r\\n, \\r), not at U+2028, NEL or form feed as str.splitlines would split, which
    would shift every later line against a parallel file."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")  # read_text turns \r\n and \r into \n
    if lines[-1] == "":  # the last line's end, or an empty file
        lines.pop()
    return lines


def _check_parallel(source: Path, target: Path, fail, lines_of):
    """(lines_of(source), lines_of(target)), after `fail(message)` if a file is missing or their line
    counts (len) differ: a line added or lost would pair every later line wrongly."""
    for path, other in ((source, target), (target, source)):
        if not Path(path).is_file():
            fail(f"no file {path} (the other side of {other})")
    source_lines, target_lines = lines_of(source), lines_of(target)
    if len(source_lines) != len(target_lines):
        fail(f"{source} has {len(source_lines)} lines but {target} has {len(target_lines)}: parallel files "
             f"must match line for line")
    return source_lines, target_lines


def read_parallel(source: Path, target: Path, fail) -> list:
    """[(source line, target line)] of two parallel files; `fail(message)` (e.g. parser.error) if one
    is missing or their line counts differ."""
    return list(zip(*_check_parallel(source, target, fail, read_lines)))


def check_parallel(source: Path, target: Path, fail):
    """read_parallel's checks, keeping one file in memory at a time (for large corpora)."""
    _check_parallel(source, target, fail, lambda path: [None] * len(read_lines(path)))


def new_file_mode(path: Path) -> int:
    """The permission bits a file written in place of `path` is to get: `path`'s own when it exists,
    else those of a file open() creates (0666 less the umask), not mkstemp's private 0600."""
    from posenc_fairseq.convert_cli import new_file_mode as umask_mode

    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return umask_mode()


@contextlib.contextmanager
def replaced_whole(path: Path):
    """A temporary file's path in `path`'s folder (ending in `path`'s suffix, for writers that go by it,
    as matplotlib does) to write into; when the block ends it replaces `path` with new_file_mode(path),
    and if the block fails it is removed: `path` is either its old self or the whole new file."""
    path = Path(path)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(handle)
    try:
        yield Path(name)
        os.chmod(name, new_file_mode(path))
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, encoding="utf-8"):
    """Write `text` to `path` through a temporary file in the same folder (replaced_whole), so that
    `path` is either its old self or the whole new text, never half written."""
    with replaced_whole(path) as temporary:
        temporary.write_text(text, encoding=encoding)


def refuse(message: str):
    """A `fail` for the checks below where no parser is at hand: the message as one error line."""
    raise SystemExit(f"error: {message}")


def check_checkpoint(path: Path, fail):
    """`fail(message)` (e.g. parser.error) unless `path` is a file in torch.save's format, as fairseq's
    checkpoints are: before any work, and with a message rather than torch.load's own error."""
    from posenc_fairseq.compat.checkpoint_loading import written_by_torch_save

    if not Path(path).is_file():
        fail(f"no checkpoint file {path}")
    try:
        readable = written_by_torch_save(path)
    except OSError as error:
        fail(f"cannot read {path}: {error.strerror or error}")
    if not readable:
        fail(f"{path} is not a fairseq checkpoint (not a file written by torch.save)")


def check_output(path: Path, inputs, fail) -> Path:
    """`path`, where a script will write a result, checked before the work that makes it (`fail(message)`,
    e.g. parser.error): not a folder, not one of `inputs` (files read, or folders whose existing files
    are read; links resolved), since an output must never replace what the run reads, and in a folder
    that exists or can be made. Returns it as a Path."""
    path = Path(path)
    if path.is_dir():
        fail(f"{path} is a folder: give a file name to write")
    target = path.resolve()
    for source in map(Path, inputs):
        source = source.resolve()
        if target == source or (source.is_dir() and target.exists() and target.is_relative_to(source)):
            fail(f"{path} would replace an input ({source}): give another path to write")
    existing = next(folder for folder in target.parents if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        fail(f"cannot write {path}: {existing} is not a folder this user may write in")
    return path


def check_output_folder(path: Path, inputs, fail) -> Path:
    """`path`, a folder a script will build and put in place of an earlier one (deleting all it holds),
    checked before the work: it must not be, or hold, one of `inputs` (files or folders the run reads),
    or it would delete them (links resolved: an input named through a link elsewhere counts). Returns it
    as a Path."""
    path = Path(path)
    target = path.resolve()
    for source in map(Path, inputs):
        if source.resolve() == target or source.resolve().is_relative_to(target):
            fail(f"{path} would replace an input ({source}): give another output folder")
    return path


def write_output(path: Path, text: str):
    """`text` written whole to `path` (write_text_atomic), its folder made first; an OSError (disk
    full, read-only folder) ends the script with one line instead of a traceback."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as error:
        raise SystemExit(f"error: cannot write {path}: {error.strerror or error}") from None


def fairseq_command(name: str) -> str:
    """fairseq's command `name` (fairseq-generate, ...) beside this Python where it is (a venv's
    python run without the venv on PATH), else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def increasing_counts(minimum: int, what: str):
    """An argparse `type`: comma-separated increasing integers >= minimum (`what` they count, for the
    message), e.g. the edges of length bins."""
    def parse(text):
        try:
            edges = [int(edge) for edge in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {what}: {text!r}") from None
        if edges[0] < minimum or any(high <= low for low, high in zip(edges, edges[1:])):
            raise argparse.ArgumentTypeError(f"{what} must be at least {minimum} and increasing: {text!r}")
        return edges

    parse.__name__ = what
    return parse


def results_by_name(paths, prefix: str, load, fail) -> dict:
    """Each result file's `load(path, fail)` under its name: the file's stem without `prefix`
    (bleu_xl.json -> xl). Two files of one name are refused (`fail`, e.g. argparse's error)."""
    results = {}
    for path in paths:
        name = path.stem[len(prefix):] if path.stem.startswith(prefix) else path.stem
        result = load(path, fail)  # (a missing file is named as such, not as a second result)
        if name in results:
            fail(f"two results named {name} ({path} and an earlier file)")
        results[name] = result
    return results


def markdown_table(header, rows) -> list:
    """A Markdown table's lines: `header`'s cells, the rule under them, then each row's cells (str() of each)."""
    def line(cells):
        return "| " + " | ".join(map(str, cells)) + " |"
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]
