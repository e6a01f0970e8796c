"""posenc-fairseq: positional encodings for fairseq transformers, loaded with
`--user-dir posenc_fairseq` (or `import posenc_fairseq`).

Importing registers the models `posenc_transformer`, `posenc_roberta` and `posenc_lm`, an architecture per
encoding and size (see README), after applying the plugin's fixes to fairseq-fixed, torch and numpy
(`compat/`, each applied only where still needed; `python -m posenc_fairseq.compat` lists them):
fairseq checkpoints load under torch >= 2.6, fairseq no longer silently drops the last evaluation
batch nor fails on numpy 2 in language-model inference, importing fairseq leaves the root logger as
it was, and an option value an encoding refuses (OptionValueError) ends a command with one `error:`
line instead of a traceback.
"""
from . import compat

compat.apply()

from . import encodings, models  # noqa: E402,F401

__version__ = "0.1.0"
