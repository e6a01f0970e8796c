"""Whole models with POSENC_TRITON_ATTENTION=on (kernels/triton_attention.py) against the default paths:
every parameter's gradient, the calls that take the kernel counted (so that a silent fallback cannot
pass for equality). On CPU the kernel runs in Triton's interpreter (tests/conftest.py)."""
import pytest
import torch

from posenc_fairseq.kernels import triton_attention as fused
from devices import bound
from test_checkpoint_activations import gradients, gradients_of_steps
from test_ddp import fairseq_c10d, process_group  # noqa: F401 (a fixture)

#: (encoding, options, self-attention layers with a term per stack): the bias-only terms (T5/AT5: the
#: first layer by default), Shaw's and LFHC's key terms with and without their value terms, XL's and
#: GCDF's (with u and v)
CASES = [("t5", [], 1), ("t5_nob", [], 1), ("at5", [], 1), ("at5_nob", [], 1), ("alibi", [], 2), ("shaw", [], 2),
         ("lfhc", [], 2), ("lfhc", ["--lfhc-values", "on"], 2), ("xl", [], 2),
         ("gcdf", [], 2)]


@pytest.fixture
def counted(monkeypatch):
    """The calls that take the fused kernel."""
    calls = []
    attend = fused.attend
    monkeypatch.setattr(fused, "attend", lambda call: calls.append(call.q.shape) or attend(call))
    return calls


@pytest.mark.parametrize("encoding,extra,per_stack", CASES, ids=[" ".join([n, *e]) for n, e, _ in CASES])
def test_models_train_with_the_same_gradients_as_the_default_paths(translation_data, kernel_device, monkeypatch,
                                                                    counted, encoding, extra, per_stack):
    """Encoder over left-padded sources, decoder under fairseq's future mask: the loss's gradient of
    every parameter (the encoding's tables and MLPs included) as with the switch off."""
    monkeypatch.setenv(fused.SWITCH, "on")
    model, got = gradients(translation_data, encoding, extra, device=kernel_device)
    assert len(counted) == 2 * per_stack
    monkeypatch.setenv(fused.SWITCH, "off")
    counted.clear()
    _, expected = gradients(translation_data, encoding, extra, model.state_dict(), device=kernel_device)
    assert not counted
    assert sorted(got) == sorted(expected)
    limit = bound(kernel_device, "triton vs default paths")
    for name, value in expected.items():
        assert (got[name] - value).abs().max() <= limit * (1 + value.abs().max()), name
    if encoding != "alibi":
        assert any(got[name].abs().max() > 0 for name in got if name.startswith("positional_encoding."))


@pytest.mark.parametrize("encoding", ["t5", "shaw", "xl"])  # a bias; shared vectors and values; per-head vectors
def test_long_uneven_batches_over_many_tiles(translation_data, kernel_device, monkeypatch, counted, encoding):
    """Sources and targets several tiles long (the interpreter's tiles are 16, CUDA's 32 or 64), the sources
    left-padded to uneven lengths, one of them a single token: padded tiles skipped, the causal
    diagonal tiles, ragged ends, and for Shaw tiles at the tables' clipped ends (T5's term is a
    value per distance, without rows). Every gradient
    as on the default paths."""
    from fairseq.data import Dictionary
    from util import random_batch

    source, target = (33, 17) if kernel_device.type == "cpu" else (300, 260)
    dictionary = Dictionary.load(str(translation_data / "dict.src.txt"))
    src, _, prev = random_batch(dictionary, batch=3, src_len=source, tgt_len=target, seed=3)
    lengths = torch.tensor([source, source // 2, 1])
    for row, length in enumerate(lengths.tolist()):
        src[row, : source - length] = dictionary.pad()
        src[row, -1] = dictionary.eos()
    batch = (src, lengths, prev)
    # (one layer each in the interpreter, for time)
    layers = ["--encoder-layers", "1", "--decoder-layers", "1"] if kernel_device.type == "cpu" else []
    kernels = fused._kernels()
    clamped = []  # (whether each call's tables have ends: Shaw's clipped distances)
    forward = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda inputs: clamped.append(inputs.clamped) or forward(inputs))
    monkeypatch.setenv(fused.SWITCH, "on")
    model, got = gradients(translation_data, encoding, layers, device=kernel_device, batch=batch)
    assert len(counted) == 2 * (1 if encoding == "t5" or layers else 2)
    assert any(clamped) == (encoding == "shaw")
    monkeypatch.setenv(fused.SWITCH, "off")
    _, expected = gradients(translation_data, encoding, layers, model.state_dict(), device=kernel_device, batch=batch)
    limit = bound(kernel_device, "triton vs default paths")
    for name, value in expected.items():
        assert (got[name] - value).abs().max() <= limit * (1 + value.abs().max()), name


def test_pruned_heads(kernel_device, monkeypatch, counted):
    """After head pruning the kept heads' bias rows serve the kernel (encoder self-attention over a
    padded batch whose last sentence is all padding)."""
    from util import attention_call

    if kernel_device.type != "cpu":
        pytest.skip("util.attention_call builds the bound attention on the CPU")
    module, call = attention_call("t5", [], "encoder")
    module._adaptive_prune_heads([(0, module.head_dim), (2 * module.head_dim, 3 * module.head_dim)])
    monkeypatch.setenv(fused.SWITCH, "off")
    expected = call()
    monkeypatch.setenv(fused.SWITCH, "on")
    got = call()
    assert len(counted) == 1 and got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5




@pytest.mark.parametrize("encoding,extra", [("xl", [])])
def test_activation_checkpointing_recomputes_through_the_kernel(translation_data, kernel_device, monkeypatch, counted,
                                                               encoding, extra):
    """fairseq's --checkpoint-activations: each layer's recomputation in backward takes the kernel
    again (its mask read, not the stack's), with the same gradients as without checkpointing (XL:
    u and v shared by the layers)."""
    monkeypatch.setenv(fused.SWITCH, "on")
    model, plain = gradients(translation_data, encoding, extra, device=kernel_device)
    counted.clear()
    _, checkpointed = gradients(translation_data, encoding, [*extra, "--checkpoint-activations"], model.state_dict(),
                                device=kernel_device)
    assert len(counted) == 2 * 4  # 4 self-attention layers, each run and recomputed
    assert sorted(checkpointed) == sorted(plain)
    for name, value in plain.items():
        assert (checkpointed[name] - value).abs().max() <= bound(kernel_device, "checkpointed vs plain") * (
            1 + value.abs().max()), name


@pytest.mark.parametrize("encoding", ["at5", "xl", "shaw"])
def test_decoding_steps_equal_the_full_pass(translation_data, kernel_device, monkeypatch, counted, encoding):
    """Step by step the decoder takes the STEP kernel (its terms folded into q, k, v), the full pass
    this one: the same logits."""
    from test_every_encoding import perturb_away_from_identity
    from util import TINY_TRANSFORMER, build_model, random_batch

    monkeypatch.setenv(fused.SWITCH, "on")
    torch.manual_seed(0)
    model, task, _ = build_model(translation_data, f"transformer_{encoding}",
                                  [*TINY_TRANSFORMER, "--scalar-bias-layers", "all"] if encoding == "at5" else TINY_TRANSFORMER)
    perturb_away_from_identity(model)
    model.eval().to(kernel_device)
    src, src_lengths, prev = (x.to(kernel_device) for x in random_batch(task.source_dictionary, batch=3, src_len=9,
                                                                          tgt_len=7))
    with torch.no_grad():
        full = model(src, src_lengths, prev)[0]
        assert len(counted) == 4
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state = {}
        steps = torch.cat([model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                           for t in range(prev.size(1))], dim=1)
    assert len(counted) == 4 + 2  # the encoder's two layers once more; no decoding step
    assert (steps - full).abs().max() <= bound(kernel_device, "steps vs pass")


def test_ddp_with_checkpointing_takes_the_kernel(translation_data, kernel_device, process_group,  # noqa: F811
                                                 monkeypatch, counted):
    """torch DDP as fairseq wraps the model (gloo on the CPU, NCCL on CUDA) with --checkpoint-activations,
    two steps through the kernel: the plain model's gradients on the default paths (XL: u and v shared
    by every layer, reduced once per backward)."""
    model, expected = gradients_of_steps(translation_data, "xl", [], device=kernel_device)
    assert not counted
    monkeypatch.setenv(fused.SWITCH, "on")
    state = {k: v for k, v in model.state_dict().items() if "window_" not in k}
    _, got = gradients_of_steps(translation_data, "xl", ["--checkpoint-activations"], state, wrap=fairseq_c10d,
                                device=kernel_device)
    assert len(counted) == 2 * 2 * 4  # two steps; 4 self-attention layers, each run and recomputed
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert sorted(a) == sorted(b)
        limit = bound(kernel_device, "triton vs default paths")
        for name, value in b.items():
            assert (a[name] - value).abs().max() <= limit * (1 + value.abs().max()), (step, name)


def test_attention_dropout_through_the_kernel_is_recomputed_alike(translation_data, kernel_device, monkeypatch):
    """--attention-dropout (RoBERTa's 0.1 in training) takes the kernel, which draws its mask from a seed
    of torch's generator: --checkpoint-activations recomputes each layer with the mask its first run
    drew (checkpointing restores the generator), so the gradients equal the plain run's. XL: u and v
    shared by every layer."""
    dropout_p = []
    attend = fused.attend
    monkeypatch.setattr(fused, "attend", lambda call: dropout_p.append(call.dropout_p) or attend(call))
    monkeypatch.setenv(fused.SWITCH, "on")
    dropout = ["--attention-dropout", "0.3"]
    model, plain = gradients(translation_data, "xl", dropout, device=kernel_device)
    _, checkpointed = gradients(translation_data, "xl", [*dropout, "--checkpoint-activations"], model.state_dict(),
                                device=kernel_device)
    assert dropout_p == [0.3] * (4 + 2 * 4)  # 4 self-attention layers; checkpointed, each run and recomputed
    limit = bound(kernel_device, "triton vs default paths")
    assert sorted(checkpointed) == sorted(plain)
    for name, value in plain.items():
        assert (checkpointed[name] - value).abs().max() <= limit * (1 + value.abs().max()), name
