from . import lm, roberta, transformer  # noqa: F401  (registers the models and architectures)
