"""posenc-fairseq: positional encodings for fairseq transformers, loaded with
`--user-dir posenc_fairseq` (or `import posenc_fairseq`).

Importing registers the models `posenc_transformer` and `posenc_roberta`, an architecture per
encoding and size (see README), makes fairseq checkpoints loadable under torch >= 2.6, and stops
fairseq-fixed from silently dropping the last evaluation batch (batching_fix.py).
"""
from .batching_fix import keep_last_batch
from .checkpoint_compat import allow_fairseq_checkpoints

allow_fairseq_checkpoints()
keep_last_batch()

from . import encodings, models  # noqa: E402,F401

__version__ = "0.1.0"
