"""The old name of `posenc_fairseq.kernels.flex` (FlexAttention), kept because users, tests and
scripts/gpu_check.py set `MODE` (and tests `attend`) through it: this name is the same module
object, so an attribute set through either name is the kernel's own."""
import sys

from .kernels import flex

sys.modules[__name__] = flex
