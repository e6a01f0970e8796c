"""Give fairseq-fixed 0.12.3.1 the `numpy.compat` it still uses under numpy 2.

numpy 2 removed `numpy.compat`; fairseq-fixed still writes `np.compat.long` (= Python `int` in numpy
1.x) in `TokenBlockDataset` with `break_mode="eos"` and in `LanguagePairDataset`. Every language-model
path that builds an "eos"-mode block dataset fails with "module 'numpy' has no attribute 'compat'":
the hub interface of any language model (`.sample()`, `.score()`, `.generate()`: the language_modeling
task's `build_dataset_for_inference`), and `--sample-break-mode eos`. Importing the plugin adds back
exactly that one name, only when numpy lacks it.
"""
import types

import numpy as np


def restore_numpy_compat_long():
    try:
        np.compat.long  # noqa: B018  (numpy 1.x: present)
    except AttributeError:
        np.compat = types.SimpleNamespace(long=int)
