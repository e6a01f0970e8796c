"""The attention kernels and the plan that picks one per call (docs/design.md).

plan.py        `AttentionCall` (what one call is), `plan()` (which kernel serves it), `Plan`
serve.py       runs a plan: the kernel, whole or in query blocks
blocks.py      query blocks of long inputs (sizes, the loop, recomputation in backward)
terms.py       the dense form of the position terms and masks (B, H, Tq, Tk)
masks.py       facts about fairseq's masks; the fill value of a blocked logit
subnormals.py  CPU: flushing subnormals in the backward of attention with wide-range terms
step.py        STEP: a decoding step, the encoding's terms folded into q, k, v
explicit.py    EXPLICIT and LOGITS: the softmax written out
sdpa.py        SDPA: PyTorch's fused attention with the dense terms as its mask
biased_cpu.py  BIASED_CPU: fused CPU forward, blockwise backward, for terms with a gradient
flex.py        FLEX: FlexAttention reading per-distance terms inside the kernel
triton_attention.py  TRITON: one Triton kernel (triton_kernels.py) reading the per-distance terms
               inside, forward and backward
"""
