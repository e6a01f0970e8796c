"""`plan(call)` as a value: a pure function of the `AttentionCall`, whose fields (grad mode,
recorded run, FlexAttention and Triton switches) and tensors decide the kernel, with no encoding and no global
state read. Each case builds the call by hand and states the kernel the rules of plan.py give."""
import pytest
import torch

from posenc_fairseq.encodings.distance import DistanceTerm
from posenc_fairseq.kernels import biased_cpu
from posenc_fairseq.kernels.plan import AttentionCall, Kernel, plan

HEADS, DIM = 2, 4


def call(queries=5, keys=5, dtype=torch.float32, bias=False, vectors=False, content=False, values=False,
         parameters_grad=True, queries_grad=False, grad_enabled=True, recorded_run=False, flex_mode="off",
         triton_mode="off",
         need_weights=False, before_softmax=False, future_blocked=False, logits=None, batch=1,
         stack_mask=False, padding=False, future_mask=False):
    """A self-attention call of `queries` queries (the last of `keys` keys) with the chosen terms."""
    q = torch.randn(batch, HEADS, queries, DIM, dtype=dtype, requires_grad=queries_grad)
    k = torch.randn(batch, HEADS, keys, DIM, dtype=dtype)
    low, high = 1 - keys, queries - 1
    columns = high - low + 1

    def parameter(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=parameters_grad)
    term = None
    if bias or vectors or content:
        term = DistanceTerm(low, high, bias=parameter(HEADS, columns) if bias else None,
                            vectors=parameter(HEADS, columns, DIM) if vectors else None,
                            content=parameter(HEADS, 1, DIM) if content else None)
    value_term = DistanceTerm(low, high, vectors=parameter(HEADS, columns, DIM)) if values else None
    attn_mask = None
    if stack_mask or future_mask:
        attn_mask = torch.zeros(queries, keys).masked_fill(future(queries, keys), float("-inf"))
    key_padding_mask = torch.zeros(batch, keys, dtype=torch.bool) if padding else None
    return AttentionCall(q=q, k=k, v=k, k_target=k, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                         source_keys=0, stack_mask=stack_mask,
                         need_weights=need_weights, before_softmax=before_softmax, term=term, values=value_term,
                         future_blocked=future_blocked, dropout_p=0.0,
                         logits=logits if logits is not None else batch * HEADS * queries * keys,
                         grad_enabled=grad_enabled, recorded_run=recorded_run, flex_mode=flex_mode,
                         triton_mode=triton_mode)


def future(queries, keys):
    """Where fairseq's future mask blocks: keys after their query (the queries are the last keys)."""
    return torch.ones(queries, keys, dtype=torch.bool).triu(keys - queries + 1)


LARGE = biased_cpu.MIN_LOGITS  # a call the fused CPU kernel serves


@pytest.mark.parametrize("case,expected", [
    (dict(), Kernel.SDPA),  # no terms
    (dict(bias=True), Kernel.SDPA),  # a small call: the fused CPU kernel does not pay
    (dict(bias=True, logits=LARGE), Kernel.BIASED_CPU),
    (dict(bias=True, logits=LARGE, grad_enabled=False), Kernel.SDPA),  # no gradient: plain SDPA
    (dict(bias=True, logits=LARGE, parameters_grad=False), Kernel.SDPA),  # frozen terms
    (dict(bias=True, logits=LARGE, dtype=torch.float64), Kernel.SDPA),  # float32 only
    (dict(vectors=True), Kernel.EXPLICIT),  # blockwise terms with a gradient: not SDPA's unfused fallback
    (dict(vectors=True, grad_enabled=False), Kernel.SDPA),
    (dict(vectors=True, parameters_grad=False), Kernel.SDPA),
    (dict(vectors=True, parameters_grad=False, queries_grad=True), Kernel.EXPLICIT),  # q . r needs q's gradient
    (dict(vectors=True, logits=LARGE), Kernel.BIASED_CPU),
    (dict(content=True, parameters_grad=False), Kernel.SDPA),  # content folded into the queries
    (dict(values=True), Kernel.EXPLICIT),
    (dict(bias=True, need_weights=True), Kernel.EXPLICIT),
    (dict(bias=True, before_softmax=True), Kernel.LOGITS),
    (dict(bias=True, queries=1, keys=7), Kernel.STEP),
    (dict(bias=True, flex_mode="on", grad_enabled=False), Kernel.FLEX),  # (CPU: no gradient)
    (dict(bias=True, flex_mode="on"), Kernel.SDPA),  # "on": calls without gradient only
    (dict(bias=True, flex_mode="train", grad_enabled=False), Kernel.FLEX),
    (dict(bias=True, flex_mode="off", grad_enabled=False), Kernel.SDPA),
    # the Triton kernel (kernels/triton_attention.py): relative terms, padding and the future mask only
    (dict(bias=True, triton_mode="interpreted"), Kernel.TRITON),
    (dict(bias=True, triton_mode="interpreted", padding=True, stack_mask=True, future_blocked=True), Kernel.TRITON),
    (dict(bias=True, triton_mode="interpreted", future_mask=True, future_blocked=True), Kernel.TRITON),  # read
    (dict(bias=True, triton_mode="interpreted", grad_enabled=False), Kernel.TRITON),
    (dict(bias=True, triton_mode="interpreted", queries=1, keys=7), Kernel.STEP),
    (dict(bias=True, triton_mode="on"), Kernel.SDPA),  # compiled: CUDA tensors only
    (dict(vectors=True, triton_mode="auto"), Kernel.EXPLICIT),  # the default: CUDA tensors only
    (dict(bias=True, triton_mode="interpreted", need_weights=True), Kernel.EXPLICIT),
    (dict(bias=True, triton_mode="interpreted", before_softmax=True), Kernel.LOGITS),
    (dict(vectors=True, triton_mode="interpreted"), Kernel.TRITON),  # Shaw/LFHC
    (dict(vectors=True, content=True, triton_mode="interpreted"), Kernel.TRITON),  # XL/GCDF
    (dict(vectors=True, values=True, triton_mode="interpreted"), Kernel.TRITON),  # Shaw's value term
    (dict(vectors=True, values=True, triton_mode="interpreted", need_weights=True), Kernel.EXPLICIT),
])
def test_the_kernel_follows_from_the_call_alone(case, expected):
    """The same call gives the same plan whatever torch's grad mode is when `plan` runs."""
    value = call(**case)
    for mode in (True, False):
        with torch.set_grad_enabled(mode):
            assert plan(value).kernel is expected


def test_the_triton_kernel_takes_attention_dropout_and_leaves_source_keys_to_the_other_paths():
    """Dropout is drawn inside the kernel, over fewer than 2^32 (query, key) pairs of a head (a 32-bit
    counter: 65536 x 65536 keys are left to the other paths)."""
    served = call(bias=True, triton_mode="interpreted")
    assert plan(served).kernel is Kernel.TRITON
    assert plan(served._replace(dropout_p=0.1)).kernel is Kernel.TRITON
    huge = torch.zeros(1).expand(1, HEADS, 2 ** 16, DIM)  # (no memory)
    assert plan(served._replace(q=huge, k=huge, v=huge, k_target=huge)).kernel is Kernel.TRITON
    assert plan(served._replace(q=huge, k=huge, v=huge, k_target=huge, dropout_p=0.1)).kernel is not Kernel.TRITON
    assert plan(served._replace(source_keys=2)).kernel is not Kernel.TRITON


def test_query_blocks_and_their_recomputation_follow_from_the_call():
    long = dict(vectors=True, queries=600, keys=600, batch=4)
    blocked = plan(call(**long))
    assert blocked.query_block is not None and blocked.query_block < 600
    assert blocked.recompute_blocks  # training: blocks recomputed in backward
    assert not plan(call(**long, recorded_run=True)).recompute_blocks  # a layer's checkpoint covers them
    assert not plan(call(**long, grad_enabled=False)).recompute_blocks
    assert plan(call(**long, need_weights=True)).query_block is None  # weights asked for: one piece
    assert plan(call(**long, grad_enabled=False)) == plan(call(**long, grad_enabled=False))  # a value


def test_blocks_under_the_future_mask_keep_their_terms_up_to_a_size():
    """On the fused CPU path a causal call's blocks keep their terms for backward (half the call's pairs:
    faster than recomputing them) while that stays under KEEP_TERMS_BYTES; beyond, they are recomputed
    (before, always kept: memory O(T^2) per layer where stock's is O(T); figures in docs/benchmarks.md)."""
    from posenc_fairseq.kernels.plan import KEEP_TERMS_BYTES

    causal = call(vectors=True, future_blocked=True, logits=LARGE)

    def of_length(length):  # (expanded: no memory)
        x = torch.zeros(1).expand(1, HEADS, length, DIM)
        return causal._replace(q=x, k=x, v=x, k_target=x, logits=HEADS * length * length)

    length = 1 + int((2 * KEEP_TERMS_BYTES / (HEADS * 4)) ** 0.5)  # just past the size, float32
    assert plan(of_length(length)).query_block is not None and plan(of_length(length)).recompute_blocks
    assert plan(of_length(length - 2)).query_block is not None and not plan(of_length(length - 2)).recompute_blocks
    assert not plan(of_length(length)._replace(recorded_run=True)).recompute_blocks  # a layer's checkpoint covers them


def test_content_is_folded_into_the_queries_except_on_flex():
    assert plan(call(content=True)).fold_content
    assert not plan(call(content=True, flex_mode="on", grad_enabled=False)).fold_content


@pytest.mark.parametrize("case,causal", [
    (dict(stack_mask=True), True),  # fairseq's future mask alone: SDPA told is_causal
    (dict(stack_mask=True, padding=True), False),  # padded keys: the mask is given
    (dict(stack_mask=True, bias=True, grad_enabled=False), False),  # position terms: given with the mask
    (dict(stack_mask=True, need_weights=True), False),  # weights asked for: EXPLICIT
    (dict(), False),  # no mask
    (dict(future_mask=True), True),  # the same mask, not the stack's (a checkpointed layer's recomputation): read
    (dict(future_mask=True, queries=4, keys=6), False),  # not square (cached keys)
])
def test_sdpa_is_told_the_mask_is_causal_only_where_it_is_all_there_is(case, causal):
    assert plan(call(**case)).causal is causal


@pytest.mark.parametrize("grad", [False, True])
def test_the_causal_plan_gives_the_masked_output(grad):
    from posenc_fairseq.kernels.serve import serve
    value = call(queries=6, keys=6, batch=2, stack_mask=True, queries_grad=grad)
    assert plan(value).causal
    out, _ = serve(value, plan(value), lambda probs: probs)
    logits = (value.q @ value.k.transpose(-1, -2)).masked_fill(future(6, 6), float("-inf"))
    assert torch.allclose(out, torch.softmax(logits, -1) @ value.v, atol=1e-6)


def test_query_dependent_terms_with_a_gradient_take_sdpa_where_it_fuses_the_mask_gradient(monkeypatch):
    """CUDA's memory-efficient SDPA returns the float mask's gradient: XL's and Shaw's key terms with a
    gradient go there instead of the explicit softmax (on CPU, where it has no such kernel: EXPLICIT)."""
    from posenc_fairseq.kernels import sdpa
    assert plan(call(vectors=True)).kernel is Kernel.EXPLICIT
    monkeypatch.setattr(sdpa, "fused_mask_gradient", lambda q: True)
    assert plan(call(vectors=True)).kernel is Kernel.SDPA
    assert plan(call(values=True)).kernel is Kernel.EXPLICIT  # the value term needs the probabilities


@pytest.mark.parametrize("mask,causal", [
    (torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf")), True),
    (torch.ones(4, 4, dtype=torch.bool).triu(1), True),
    (torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(2), float("-inf")), False),  # sees one ahead
    (torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -1e4), False),  # finite: a term
    (torch.full((4, 4), float("-inf")).triu(1) + torch.eye(4), False),  # a finite term on the diagonal
])
def test_a_mask_not_made_by_the_stack_is_causal_only_if_it_is_the_future_mask(mask, causal):
    from posenc_fairseq.kernels.masks import is_future_mask
    assert is_future_mask(mask) is causal
