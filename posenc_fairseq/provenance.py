"""Which source produced a recorded result: the commit of this package's git checkout."""
import subprocess
from pathlib import Path
from typing import Optional

#: the checkout this package is imported from (an editable install or the repository itself)
SOURCE = Path(__file__).resolve().parents[1]


def source_commit(digits: int = 12) -> Optional[str]:
    """The checkout's HEAD (`digits` hex digits), with `-dirty` where tracked files differ from it;
    None where the package is not imported from a git checkout (an installed copy)."""
    def git(*words):
        return subprocess.run(["git", "-C", str(SOURCE), *words], capture_output=True, text=True, timeout=10)
    try:
        if Path(git("rev-parse", "--show-toplevel").stdout.strip() or "/nonexistent").resolve() != SOURCE:
            return None  # (an installed copy inside some other repository: its HEAD is not this source's)
        head = git("rev-parse", f"--short={digits}", "HEAD").stdout.strip()
        dirty = head and git("diff", "--quiet", "HEAD").returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) if head else None
