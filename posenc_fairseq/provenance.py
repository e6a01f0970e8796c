"""Which source produced a recorded result: the commit of this package's git checkout."""
import os
import subprocess
from pathlib import Path
from typing import Optional

#: the checkout this package is imported from (an editable install or the repository itself)
SOURCE = Path(__file__).resolve().parents[1]
COMMIT_VARIABLE = "POSENC_SOURCE_COMMIT"


def source_commit(digits: int = 12) -> Optional[str]:
    """The checkout's HEAD (`digits` hex digits), with `-dirty` where tracked files differ from it;
    None where the package is not imported from a git checkout (an installed copy). A copy without its
    git, or with a stale one (a GPU machine's copy of the working tree), is told by COMMIT_VARIABLE,
    which scripts/gpu_carry.sh records where the copy is made."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]

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
