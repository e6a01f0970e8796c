"""Training through kernels/biased_cpu.py (CPU, float32): whole models give the same gradients as
through the explicit softmax, for every encoding whose position terms need a gradient."""
import pytest

from posenc_fairseq.kernels import blocks as block_module
from posenc_fairseq.kernels import biased_cpu as biased
from test_checkpoint_activations import gradients

CASES = [("t5", []), ("t5_nob", []), ("at5", []), ("at5_nob", []), ("xl", []), ("gcdf", []),
         ("shaw", ["--shaw-values", "off"])]


@pytest.mark.parametrize("query_blocks", [False, True])
@pytest.mark.parametrize("encoding,extra", CASES, ids=[name for name, _ in CASES])
def test_models_train_with_the_same_gradients_as_the_explicit_path(translation_data, monkeypatch, encoding,
                                                                   extra, query_blocks):
    """Encoder, decoder under fairseq's future mask, left-padded sources; with `query_blocks` the
    relative encodings run a few queries at a time (recomputed in backward) on the fused path."""
    monkeypatch.setattr(biased, "MIN_LOGITS", 0)  # (tiny models: the fused path from the first logit)
    calls = []
    attend = biased.attend
    monkeypatch.setattr(biased, "attend", lambda *args: calls.append(1) or attend(*args))
    if query_blocks:
        monkeypatch.setattr(block_module, "QUERY_BLOCK", 3)
        monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    fused_model, fused = gradients(translation_data, encoding, extra)
    assert calls
    monkeypatch.setattr(biased, "serves_call", lambda *args: False)
    _, plain = gradients(translation_data, encoding, extra, fused_model.state_dict())
    assert sorted(fused) == sorted(plain)
    for name, expected in plain.items():
        assert (fused[name] - expected).abs().max() <= 1e-5 * (1 + expected.abs().max()), name
