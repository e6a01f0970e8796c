"""Give fairseq-fixed 0.12.3.1 the `numpy.compat.long` it still uses, which numpy 2 removed.

fairseq-fixed writes `np.compat.long` (= Python `int` in numpy 1.x) in `TokenBlockDataset` with
`break_mode="eos"` and in `LanguagePairDataset`. Under numpy 2 every language-model path that builds
an "eos"-mode block dataset fails with "module 'numpy' has no attribute 'compat'": the hub interface
of any language model, stock ones included (`.sample()`, `.score()`, `.generate()`: the
language_modeling task's `build_dataset_for_inference`), and `--sample-break-mode eos`. The patch
adds back exactly that one name, only when numpy lacks it; nothing that works under numpy 2 changes.
"""
import types

import numpy as np


def apply():
    if hasattr(getattr(np, "compat", None), "long"):
        return None
    np.compat = types.SimpleNamespace(long=int)
    return (f"numpy {np.__version__} has no numpy.compat.long, which fairseq uses to build language-model data "
            "(hub .sample()/.score(), --sample-break-mode eos); added back as int")
