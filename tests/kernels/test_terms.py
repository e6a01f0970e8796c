"""kernels/terms.py with the pass scope: a bias-only term under the stack's future mask is masked once per
pass and shared by the layers (before, each layer made and kept for its backward an (H, T, T) copy; figures
in docs/benchmarks.md), and a stack's shared terms are let go when its pass ends, not at its next pass."""
import pytest
import torch

from posenc_fairseq.kernels import terms
from util import build_model

LM = ["--decoder-layers", "3", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
      "--decoder-attention-heads", "4", "--tokens-per-sample", "64", "--dropout", "0", "--attention-dropout", "0"]


def lm_model(data, encoding, *extra):
    torch.manual_seed(0)
    model, task, _ = build_model(data, f"transformer_lm_{encoding}", [*LM, *extra], task="language_modeling")
    return model, task


def random_tokens(dictionary, batch, length):
    return torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=torch.Generator().manual_seed(0))


def counting_masks(monkeypatch):
    made = []
    original = terms._blocked

    def blocked(call, additive, rows_without_keys_at_zero):
        made.append(call.q.size(2))
        return original(call, additive, rows_without_keys_at_zero)

    monkeypatch.setattr(terms, "_blocked", blocked)
    return made


@pytest.mark.parametrize("encoding", ["alibi", "t5"])
def test_the_layers_of_a_causal_stack_share_one_masked_term(masked_lm_data, monkeypatch, encoding):
    extra = ["--scalar-bias-layers", "all", "--scalar-bias-share-layers"] if encoding == "t5" else []
    model, task = lm_model(masked_lm_data, encoding, *extra)
    model.train()
    tokens = random_tokens(task.source_dictionary, batch=2, length=20)
    made = counting_masks(monkeypatch)
    logits, _ = model(tokens)
    logits.float().logsumexp(-1).sum().backward()
    assert made == [20]  # one masked term for the three layers, kept once for their backward
    # the same gradients as each layer masking its own copy
    shared = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    monkeypatch.setattr(terms, "_shared_key", lambda call, rows_without_keys_at_zero: None)
    model.zero_grad()
    logits_apart, _ = model(tokens)
    logits_apart.float().logsumexp(-1).sum().backward()
    assert len(made) == 1 + 3 and torch.equal(logits, logits_apart)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, shared[name], rtol=1e-5, atol=1e-7)
    # padding (a mask a key cannot name): each layer masks for itself
    tokens[0, -5:] = task.source_dictionary.pad()
    monkeypatch.undo()
    made = counting_masks(monkeypatch)
    with torch.no_grad():
        model(tokens)
    assert made == [20] * 3


@pytest.mark.parametrize("encoding", ["alibi", "t5", "xl", "shaw"])
def test_a_stacks_shared_terms_are_let_go_when_its_pass_ends(masked_lm_data, encoding):
    model, task = lm_model(masked_lm_data, encoding)
    model.eval()
    with torch.no_grad():
        model(random_tokens(task.source_dictionary, batch=1, length=30))
    assert model.positional_encoding.cache.pass_values == {}
