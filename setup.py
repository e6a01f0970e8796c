from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    name="posenc-fairseq",
    version="0.1.0",
    description="Positional encodings for fairseq transformers (T5, AT5, Shaw, LFHC, XL, GCDF, FLOATER, ALiBi, rotary) as a --user-dir plugin",
    packages=find_packages(include=["posenc_fairseq", "posenc_fairseq.*"]),
    python_requires=">=3.10",
    # FLOATER's solve loops compiled (posenc_fairseq/encodings/floater/solver.py falls back to the same loops
    # in Python where the extension is not built)
    ext_modules=[CppExtension("posenc_fairseq._floater_solve", ["posenc_fairseq/csrc/floater_solve.cpp"],
                              extra_compile_args=["-O3"])],
    cmdclass={"build_ext": BuildExtension},
    # fairseq itself is deliberately NOT listed: the working build on Python 3.11 is the
    # fork `fairseq-fixed==0.12.3.1`, whose metadata requires torchaudio; there is no CPU
    # build of torchaudio, so resolving it replaces torch with a multi-GB CUDA build.
    # Install fairseq-fixed with `--no-deps --no-build-isolation` first (the Makefile does).
    # torch 2.5: torch.nn.attention.flex_attention (imported by the package); tested with 2.13 (CPU)
    # and 2.11 (CUDA, scripts/gpu_check.py)
    install_requires=[
        "torch>=2.5",
        "numpy",
        "torchdiffeq>=0.2.3",
    ],
    extras_require={
        "recipes": ["sacrebleu>=2.0", "sentencepiece", "matplotlib"],
        "test": ["pytest"],
    },
)
