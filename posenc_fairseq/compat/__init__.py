"""The plugin's fixes to fairseq-fixed 0.12.3.1, torch and numpy, in one place.

Importing the plugin calls `apply()`, which runs each patch of `PATCHES` in order. A patch first
checks that the problem it works around is there (by probing it where that is cheap, otherwise by
version) and changes nothing when it is not, so a fixed fairseq, torch or numpy turns it off by
itself. A patch changes the process, not one model; each module's docstring says why that is right.

`applied` maps each patch installed to why it was needed; `python -m posenc_fairseq.compat` prints it.
"""
from . import batch_by_size, checkpoint_loading, numpy_compat_long, option_errors, root_logger

# root_logger first: it must be the one that imports fairseq
PATCHES = (root_logger, batch_by_size, checkpoint_loading, numpy_compat_long, option_errors)

#: patch name -> why it was applied
applied: dict = {}


def name_of(patch) -> str:
    return patch.__name__.rsplit(".", 1)[-1]


def apply() -> dict:
    """Install each patch that is needed and not yet installed; return `applied`. Safe to call again."""
    for patch in PATCHES:
        name = name_of(patch)
        if name not in applied:
            reason = patch.apply()
            if reason:
                applied[name] = reason
    return applied


def report() -> str:
    """One line per patch: applied and why, or not needed in this process."""
    return "\n".join(f"{name_of(patch)}: {applied.get(name_of(patch), 'not needed here')}" for patch in PATCHES)
