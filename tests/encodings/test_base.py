"""The attention asks an encoding only the hooks it has (`hook_use`): plain calls of an encoding
without relative hooks build no positions, and a hook set on the object itself is still asked."""
import pytest
import torch

from posenc_fairseq.encodings import ENCODINGS
from posenc_fairseq.encodings.base import ModelDims, PositionalEncoding, hook_use
from test_attention import EMBED, HEADS, ConstantBias, pair


@pytest.mark.parametrize("name, expected", [("sinusoidal", (False, False, False)), ("nope", (False, False, False)),
                                            ("rotary", (True, False, False)), ("floater", (True, False, False)),
                                            ("t5", (False, True, False)), ("alibi", (False, True, False)),
                                            ("xl", (False, True, False)), ("shaw", (False, True, True))])
def test_hook_use_of_the_registered_encodings(name, expected):
    cls = ENCODINGS[name]
    assert hook_use(cls.__new__(cls)) == expected  # (decided by the class: no instance state needed)


def test_plain_calls_ask_no_terms(monkeypatch):
    """An encoding without relative hooks: full and step-by-step self-attention equal the unbound
    module's, and no term is asked on the way."""
    _, ours = pair("self")
    _, unbound = pair("self")
    ours.bind_position(PositionalEncoding(None, ModelDims(EMBED, HEADS, 1, 1)), "decoder", 0)

    def refuse(*args, **kwargs):
        raise AssertionError("a plain call asked for a term")
    for hook in ("distance_term", "value_term"):  # (the neutral defaults: still not the encoding's own)
        monkeypatch.setattr(PositionalEncoding, hook, refuse)
    x = torch.randn(5, 2, EMBED)
    future = torch.full((5, 5), float("-inf")).triu(1)
    assert torch.equal(ours(x, x, x, attn_mask=future)[0], unbound(x, x, x, attn_mask=future)[0])
    states = ({}, {})
    for t in range(5):
        step = [module(x[t: t + 1], x[t: t + 1], x[t: t + 1], incremental_state=state, need_weights=False)[0]
                for module, state in zip((ours, unbound), states)]
        assert torch.equal(step[0], step[1])


@pytest.mark.parametrize("need_weights", [True, False])
def test_a_hook_set_on_the_object_is_asked(need_weights):
    """A distance term set on an encoding object whose class adds nothing changes the output exactly
    as the same hook defined by a class does."""
    _, by_class = pair("self")
    _, by_object = pair("self")
    by_class.bind_position(ConstantBias(None, ModelDims(EMBED, HEADS, 1, 1)), "encoder", 0)
    plain = PositionalEncoding(None, ModelDims(EMBED, HEADS, 1, 1))
    plain.distance_term = ConstantBias.distance_term.__get__(plain)
    by_object.bind_position(plain, "encoder", 0)
    _, unbound = pair("self")
    x = torch.randn(6, 2, EMBED)
    expected = by_class(x, x, x, need_weights=need_weights)[0]
    assert torch.equal(by_object(x, x, x, need_weights=need_weights)[0], expected)
    assert not torch.allclose(unbound(x, x, x, need_weights=need_weights)[0], expected)
