"""The FlexAttention path (kernels/flex.py) against the existing paths, on CPU: FlexAttention's
eager mode (POSENC_FLEX_ATTENTION=on), forward only, so every comparison runs without gradients. Calls that take
the fused path are counted, so that a silent fallback cannot pass for equality."""
import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq.kernels import blocks as block_module
from posenc_fairseq.kernels import flex as flex_attention
from posenc_fairseq.encodings import ModelDims
from posenc_fairseq.encodings.base import hook_use
from posenc_fairseq.encodings.distance import flex_table
from position_terms import logits_between
from util import TINY_TRANSFORMER, attention_call, build_model, perturbed_encoding, random_batch

EMBED, HEADS = 16, 4  # (util.attention_call's defaults)

#: the encodings with a distance term, with options that give them one (Shaw: key term only)
DISTANCE = [("t5", []), ("t5", ["--scalar-bias-layers", "all"]), ("t5_nob", []), ("at5", []), ("at5_nob", []),
            ("alibi", []), ("shaw", ["--shaw-values", "off"]), ("lfhc", []), ("xl", []), ("gcdf", [])]
IDS = [" ".join([name, *argv]) for name, argv in DISTANCE]


@pytest.fixture
def fused(monkeypatch):
    """`fused(mode, call, grad=False)`: call() with POSENC_FLEX_ATTENTION=mode, under torch.no_grad
    unless `grad`; returns (its result, the number of calls that took the FlexAttention path)."""
    calls = []
    attend = flex_attention.attend

    def counted(*args):
        calls.append(args[0].shape)
        return attend(*args)

    monkeypatch.setattr(flex_attention, "attend", counted)

    def run(mode, call, grad=False):
        monkeypatch.setenv(flex_attention.SWITCH, mode)
        calls.clear()
        with torch.set_grad_enabled(grad):
            result = call()
        return result, len(calls)

    return run


def tiny_model(data, name, argv):
    torch.manual_seed(0)
    model, task, _ = build_model(data, f"transformer_{name}", [*TINY_TRANSFORMER, *argv])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from an identity initialisation
        for parameter in model.positional_encoding.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model.eval(), task


@pytest.mark.parametrize("name,argv", DISTANCE, ids=IDS)
def test_model_full_pass_and_decoding_steps_equal_the_explicit_path(translation_data, fused, name, argv):
    """Encoder self-attention over a left-padded source, causal decoder self-attention (one target
    row left-padded: its first queries see only padding), and step-by-step decoding."""
    model, task = tiny_model(translation_data, name, argv)
    dictionary = task.source_dictionary
    src, src_lengths, prev = random_batch(dictionary, batch=3, src_len=9, tgt_len=7)
    padded_prev = prev.clone()
    padded_prev[2, :2] = dictionary.pad()
    # the self-attention layers with a term: T5/AT5 by default only the first of each stack
    per_stack = 1 if name in ("t5", "t5_nob", "at5", "at5_nob") and "all" not in argv else 2
    for target in (prev, padded_prev):
        expected, explicit_calls = fused("off", lambda: model(src, src_lengths, target)[0])
        got, calls = fused("on", lambda: model(src, src_lengths, target)[0])
        assert explicit_calls == 0 and calls == 2 * per_stack  # those layers of both stacks
        assert (got - expected).abs().max() <= 1e-5

    def steps():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state = {}
        return torch.cat([model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                          for t in range(prev.size(1))], dim=1)

    expected, _ = fused("off", lambda: model(src, src_lengths, prev)[0])
    got, calls = fused("on", steps)
    # the encoder's layers only: a decoding step's terms are additions to plain attention's inputs
    # (`distance.step_terms`)
    assert calls == per_stack
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("name,argv", DISTANCE, ids=IDS)
def test_attention_equals_the_explicit_path_in_query_blocks_with_masks(monkeypatch, fused, name, argv, role):
    """Padding, a fully padded row (finite: uniform weights as on the explicit path), fairseq's
    causal mask with a finite entry, and the query blocks of Shaw/LFHC/XL/GCDF. (Under the causal
    mask a block leaves out the keys after its last query, so the fully padded sentence's rows,
    which see no key at all, average fewer values there: finite, and compared for the others.)"""
    _, call = attention_call(name, argv, role)
    expected, _ = fused("off", call)
    got, calls = fused("on", call)
    assert calls == 1
    assert torch.isfinite(got).all() and (got - expected).abs().max() <= 1e-5
    monkeypatch.setattr(block_module, "QUERY_BLOCK", 4)
    monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    blocked, calls = fused("on", call)
    assert calls == (3 if name in ("shaw", "lfhc", "xl", "gcdf") else 1)
    assert torch.isfinite(blocked).all()
    seen = slice(None, -1) if role == "decoder" else slice(None)  # the last sentence is all padding
    assert (blocked[:, seen] - expected[:, seen]).abs().max() <= 1e-5


def test_fully_masked_rows_are_finite(fused):
    """A left-padded causal row whose first queries see only padding, and a fully padded row: the
    blocked entries get a finite minimum, so these rows average the values instead of giving NaN."""
    module, call = attention_call("t5", [], "decoder")
    got, calls = fused("on", call)
    assert calls == 1 and torch.isfinite(got).all()
    # the fully padded row attends uniformly to every key, as the explicit path does
    expected, _ = fused("off", call)
    assert (got[:, -1] - expected[:, -1]).abs().max() <= 1e-5


@pytest.mark.parametrize("name,argv,role", [(name, argv, role) for name, argv in DISTANCE
                                             for role in ("encoder", "decoder")])
def test_flex_table_is_the_logit_term(name, argv, role):
    """FlexAttention's table and columns give exactly the term `logits_between` gathers for the
    positions given as plain tensors (the general path): a whole call, a block of queries in the
    middle and a decoding step (one query after the keys)."""
    enc = perturbed_encoding(name, *argv, dims=ModelDims(EMBED, HEADS, 2, 2))
    enc.eval()
    torch.manual_seed(2)
    keys = 9
    key = torch.randn(2, HEADS, keys, EMBED // HEADS, dtype=torch.float64)
    for layer, (first, stop) in [(layer, span) for layer in (0, 1) for span in ((0, keys), (3, 7), (keys - 1, keys))]:
        query = torch.randn(2, HEADS, stop - first, EMBED // HEADS, dtype=torch.float64)
        with torch.no_grad():
            enc.begin(role)
            expected = logits_between(enc, role, layer, query, key, torch.arange(first, stop), torch.arange(keys))
            term = enc.distance_term(role, layer, -(stop - 1), keys - 1 - first, stop - first, torch.float64)
        if term is None:  # T5/AT5 --scalar-bias-layers first: nothing in the second layer
            assert expected is None and layer == 1
            continue
        table, column, key_bias = flex_table(term, query, key)
        i, j = torch.arange(stop - first)[:, None], torch.arange(keys)[None, :]
        c = j - i + (stop - first) - 1
        c = column[c] if column is not None else c
        table = table.expand(2, HEADS, stop - first, table.size(-1))
        got = table.gather(-1, c.expand(2, HEADS, -1, -1))
        if key_bias is not None:
            got = got + key_bias[:, :, None, :]
        assert (got - expected).abs().max() <= 1e-12


def test_no_distance_term_no_hook():
    """Encodings without a distance term (rotary, FLOATER, the absolute ones) and cross-attention
    never take the fused path."""
    dims = ModelDims(EMBED, HEADS, 2, 2)
    for name in ("rotary", "sinusoidal", "nope"):
        assert not hook_use(perturbed_encoding(name, dims=dims)).logits
    assert hook_use(perturbed_encoding("t5", dims=dims)).logits
    for name in ("t5", "alibi", "shaw", "xl"):
        enc = perturbed_encoding(name, dims=dims).float()
        assert enc.distance_term("cross", 0, -2, 3, 3, torch.float32) is None


def test_pruned_heads_take_the_fused_path(fused):
    """After head pruning the kept heads' terms (`distance.for_heads`) serve FlexAttention as the
    explicit path."""
    module, call = attention_call("xl", [], "decoder")
    module._adaptive_prune_heads([(0, module.head_dim), (2 * module.head_dim, 3 * module.head_dim)])
    got, calls = fused("on", call)
    expected, _ = fused("off", call)
    assert calls == 1 and (got - expected).abs().max() <= 1e-6


FALLBACKS = ["weights", "shaw values", "lfhc values", "dropout", "retain dropout", "gradient",
             "off", "cross-attention"]


@pytest.mark.parametrize("case", FALLBACKS)
def test_fallbacks_take_the_existing_paths(fused, case):
    name, argv = {"shaw values": ("shaw", []), "lfhc values": ("lfhc", ["--lfhc-values", "on"])}.get(case, ("xl", []))
    module, call = attention_call(name, argv, "decoder")
    mode = "off" if case == "off" else "on"
    options = {}
    if case == "weights":
        options["need_weights"] = True
    elif case == "dropout":
        module.dropout_module.p = 0.1
        module.train()
    elif case == "retain dropout":
        module.dropout_module.p = 0.1
        module.dropout_module.apply_during_inference = True
    elif case == "cross-attention":
        module.encoder_decoder_attention, module.self_attention = True, False
    # "gradient": eager FlexAttention on CPU has no backward
    got, calls = fused(mode, lambda: call(**options), grad=case == "gradient")
    assert calls == 0
    if "dropout" not in case:  # the existing path's result
        expected, _ = fused("off", lambda: call(**options))
        assert got.requires_grad == (case == "gradient") and (got.detach() - expected).abs().max() <= 1e-6


@pytest.mark.parametrize("mode", ["fast", "auto"])
def test_unknown_mode_is_refused(fused, mode):
    """('auto', once the default, is gone: FlexAttention is opt-in until a GPU run shows it equal and faster.)"""
    _, call = attention_call("alibi", [], "encoder")
    with pytest.raises(ValueError, match=f"POSENC_FLEX_ATTENTION='{mode}'"):
        fused(mode, call)


def test_off_by_default():
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "POSENC_FLEX_ATTENTION"}
    out = subprocess.run([sys.executable, "-c", "from posenc_fairseq.kernels import flex; print(flex.mode())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "off"


@pytest.mark.parametrize("mode,grad,expected", [("off", False, False), ("on", False, True), ("on", True, False),
                                                ("train", True, True), ("train", False, True)])
def test_cuda_takes_flex_with_gradients_only_in_train_mode(monkeypatch, mode, grad, expected):
    """On CUDA, "on" serves calls without gradient only: the compiled backward's gradients differed
    from the reference paths in the H100 run (docs/gpu_check.md); "train" is for measuring them."""
    from types import SimpleNamespace

    cuda_queries = SimpleNamespace(is_cuda=True, size=lambda dim: 16)
    assert flex_attention.available(cuda_queries, mode, grad) == expected
    small_heads = SimpleNamespace(is_cuda=True, size=lambda dim: 8)
    assert not flex_attention.available(small_heads, mode, grad)
