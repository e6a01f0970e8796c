"""Compiles the Triton kernels (kernels/triton_kernels.py) ahead of time for NVIDIA GPUs, down to the
cubin with the wheel's ptxas: no GPU needed. Run by tests/kernels/test_triton_attention.py in a process
without TRITON_INTERPRET (under the interpreter `triton.jit` gives functions that do not compile).

    python tests/kernels/compile_triton.py CAPABILITY DTYPE...     e.g. 90 bf16 fp32
Compiled with everything on (padding, the causal mask, dropout; with vectors, tables with clipped ends).
Prints one line per kernel and term: its name, dtype, term, tile and shared memory in bytes."""
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from posenc_fairseq.kernels import triton_kernels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the pointer arguments in the inputs' dtype; the other pointers are float32 (int8: the padding)
INPUT_POINTERS = ("Q", "QR", "K", "V", "Out", "dO", "dQ", "dQR", "dK", "dV")
SIZES = ("H", "Tq", "Tk", "D")


#: the other arguments that are not int32 or float32 pointers
OTHER_TYPES = {"dropout_p": "fp32", "Pad": "*i8", "Keys": "*i32", "Seed": "*i64"}


def signature(kernel, dtype_name):
    """Each argument's type: constexpr, int32 (sizes, strides: lower case), a pointer (the inputs'
    dtype, int8 for the padding, else float32), or as OTHER_TYPES says."""
    types = {}
    for parameter in kernel.params:
        name = parameter.name
        if parameter.is_constexpr:
            types[name] = "constexpr"
        elif name in OTHER_TYPES:
            types[name] = OTHER_TYPES[name]
        elif name in SIZES or name.islower():  # (query_blocks, key_blocks too)
            types[name] = "i32"
        elif name in INPUT_POINTERS:
            types[name] = f"*{dtype_name}"
        else:
            types[name] = "*fp32"
    return types


def main(capability, dtype_names):
    target = GPUTarget("cuda", int(capability), 32)
    for dtype_name in dtype_names:
        for vectors in (False, True):  # (their tiles differ: triton_kernels.settings)
            constants = dict(triton_kernels.settings(DTYPES[dtype_name], 64, on_cuda=True, vectors=vectors),
                             HAS_BIAS=True, HAS_VECTORS=vectors, HAS_VALUES=vectors, HAS_PADDING=True, CAUSAL=True,
                             HAS_DROPOUT=True)
            gradients = {"BIAS_GRAD": True, "VECTORS_GRAD": vectors, "VALUES_GRAD": vectors}
            # (tables with clipped ends come with vectors, Shaw's and LFHC's; the bias-only encodings give a
            # value per distance, without ends)
            ends = {"CLAMPED": vectors}
            kernels = ((triton_kernels._attention_forward, ends),
                       (triton_kernels._attention_backward_keys, ends),
                       (triton_kernels._attention_backward_queries, {**ends, **gradients}),
                       (triton_kernels._attention_backward_distances, gradients))
            for kernel, extra in kernels:
                source = ASTSource(kernel, signature(kernel, dtype_name), constexprs={**constants, **extra})
                compiled = triton.compile(source, target=target)
                assert compiled.asm["cubin"], kernel.__name__
                print(kernel.__name__, dtype_name, "vectors+values" if vectors else "bias", constants["BLOCK"],
                      compiled.metadata.shared)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
