"""posenc-fairseq: positional encodings for fairseq transformers, loaded with
`--user-dir posenc_fairseq` (or `import posenc_fairseq`).

Importing registers the models `posenc_transformer`, `posenc_roberta` and `posenc_lm`, an architecture per
encoding and size (see README), makes fairseq checkpoints loadable under torch >= 2.6, and stops
fairseq-fixed from silently dropping the last evaluation batch (batching_fix.py) and from failing
on numpy 2 in language-model inference (numpy_compat.py). An option value an encoding refuses
(OptionValueError) ends a command with one `error:` line instead of a traceback.

Logging: importing fairseq configures the root logger (one of its modules calls
`logging.basicConfig(level=DEBUG)`). When fairseq is first imported through this package, the root
logger's level and handlers are put back as they were, so `import posenc_fairseq` changes no
logging the user did not ask for. (fairseq's commands configure logging themselves first.)
"""
import logging as _logging
import sys as _sys

_root = _logging.getLogger()
_root_before = None if "fairseq" in _sys.modules else (_root.level, list(_root.handlers))

from .batching_fix import keep_last_batch  # noqa: E402
from .checkpoint_compat import allow_fairseq_checkpoints  # noqa: E402
from .encodings.option_types import report_option_errors_in_one_line  # noqa: E402
from .numpy_compat import restore_numpy_compat_long  # noqa: E402

allow_fairseq_checkpoints()
keep_last_batch()
restore_numpy_compat_long()
report_option_errors_in_one_line()

from . import encodings, models  # noqa: E402,F401


def _restore_root_logger():
    if _root_before is None:
        return
    level, handlers = _root_before
    for handler in list(_root.handlers):
        if handler not in handlers:
            _root.removeHandler(handler)
    _root.setLevel(level)


_restore_root_logger()

__version__ = "0.1.0"
