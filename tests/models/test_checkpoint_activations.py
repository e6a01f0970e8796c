"""fairseq's --checkpoint-activations / --offload-activations (each layer runs under no_grad and is
recomputed during backward) give the same gradients as the plain model, for every encoding: terms
shared across layers (memoized biases, FLOATER's table) must reach their parameters."""
import threading

import pytest
import torch

from posenc_fairseq.encodings import ENCODINGS
from devices import bound, on
from test_every_encoding import perturb_away_from_identity
from util import TINY_TRANSFORMER, build_model, random_batch

NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]
CASES = [(name, []) for name in sorted(ENCODINGS)] + [("floater", ["--floater-recompute-every", "3"])]


def gradients_of_steps(data, encoding, extra, state=None, wrap=None, steps=2, device="cpu", batch=None,
                       between=None, backward=torch.Tensor.backward):
    """The model's parameter gradients of each of `steps` forward/backward passes of one loss (the same
    batch, gradients cleared between, no update) on `device`; `state`: load these parameters (else
    perturb the encoding's away from identity); `wrap`: run the model through `wrap(model)` (DDP);
    `batch`: (src, src_lengths, prev), else a small random one; `between(forward, task)`: run
    between each forward and its backward; `backward(loss)`: how the loss is differentiated."""
    torch.manual_seed(0)
    model, task, _ = build_model(data, f"transformer_{encoding}", [*TINY_TRANSFORMER, *NO_DROPOUT, *extra])
    if state is None:
        perturb_away_from_identity(model)
    else:
        model.load_state_dict(state, strict=False)
    model.train().to(device)
    model.set_num_updates(0)
    forward = wrap(model) if wrap is not None else model
    if batch is None:
        batch = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    src, src_lengths, prev = on(device, *batch)
    per_step = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        logits, _ = forward(src, src_lengths, prev)
        if between is not None:
            between(forward, task)
        backward(logits.float().log_softmax(-1)[..., 5].sum())
        per_step.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    return model, per_step


def gradients(data, encoding, extra, state=None, wrap=None, device="cpu", batch=None, between=None,
              backward=torch.Tensor.backward):
    """The model's parameter gradients of one loss (`gradients_of_steps`' first step)."""
    model, per_step = gradients_of_steps(data, encoding, extra, state, wrap, steps=1, device=device, batch=batch,
                                         between=between, backward=backward)
    return model, per_step[0]


def assert_same_gradients(actual, expected, context=""):
    """Each gradient within devices.BOUNDS' "checkpointed vs plain" of the expected one, on their device."""
    assert sorted(actual) == sorted(expected), context
    for name, value in expected.items():
        limit = bound(value.device, "checkpointed vs plain")
        assert (actual[name] - value).abs().max() <= limit * (1 + value.abs().max()), (context, name)


@pytest.mark.parametrize("flag", ["--checkpoint-activations", "--offload-activations"])
@pytest.mark.parametrize("encoding,extra", CASES, ids=[f"{n}{'-K3' if e else ''}" for n, e in CASES])
def test_activation_checkpointing_gives_the_same_gradients(translation_data, device, encoding, extra, flag):
    plain_model, plain = gradients(translation_data, encoding, extra, device=device)
    # the same parameters (not FLOATER's K-window snapshot: the plain run's first pass already opened it)
    state = {k: v for k, v in plain_model.state_dict().items() if "window_" not in k}
    checkpointed_model, checkpointed = gradients(translation_data, encoding, [*extra, flag], state, device=device)
    assert any(hasattr(layer, "precheckpoint_forward") for layer in checkpointed_model.encoder.layers)
    assert_same_gradients(checkpointed, plain)
    position_parameters = [name for name in plain if name.startswith("positional_encoding.")]
    # the position parameters really get gradient (not zero in both)
    if encoding not in ("sinusoidal", "learned", "nope", "alibi", "rotary") and not extra:
        assert any(plain[name].abs().max() > 0 for name in position_parameters)


SHARED_BIAS = ["--scalar-bias-layers", "all", "--scalar-bias-share-layers"]
BETWEEN_CASES = [("rotary", []), ("floater", []), ("xl", []), ("shaw", []), ("t5", SHARED_BIAS), ("at5", SHARED_BIAS)]


@pytest.mark.parametrize("train_mode", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("encoding,extra", BETWEEN_CASES, ids=[n for n, _ in BETWEEN_CASES])
def test_a_forward_between_forward_and_backward_changes_no_gradient(translation_data, device, encoding, extra,
                                                                    train_mode):
    """A second forward of the same model before backward (a teacher pass, a logged sample: another
    batch, other lengths and padding, without gradients) begins new passes: the recomputation of each
    checkpointed layer must still see its own forward's positions and shared terms."""
    def another_forward(forward, task):
        src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=12, tgt_len=10,
                                                           seed=5))
        model = forward.module if hasattr(forward, "module") else forward
        model.train(train_mode)
        with torch.no_grad():
            forward(src, src_lengths, prev)
        model.train()

    plain_model, plain = gradients(translation_data, encoding, extra, device=device, between=another_forward)
    state = {k: v for k, v in plain_model.state_dict().items() if "window_" not in k}
    _, checkpointed = gradients(translation_data, encoding, [*extra, "--checkpoint-activations"], state,
                                device=device, between=another_forward)
    assert_same_gradients(checkpointed, plain, encoding)


@pytest.mark.parametrize("encoding", ["shaw", "lfhc", "xl", "gcdf"])
def test_activation_checkpointing_of_long_inputs(translation_data, device, monkeypatch, encoding):
    """Long inputs of Shaw/LFHC/XL/GCDF run a block of queries at a time and recompute each block
    during backward: with fairseq's --checkpoint-activations on top (the blocks then run under
    no_grad and inside fairseq's recompute), and without blocks, the gradients are the same."""
    from posenc_fairseq.kernels import blocks as block_module

    whole_model, whole = gradients(translation_data, encoding, [], device=device)
    state = whole_model.state_dict()
    monkeypatch.setattr(block_module, "QUERY_BLOCK", 3)
    monkeypatch.setattr(block_module, "BLOCK_ELEMENTS", 1)
    for extra in ([], ["--checkpoint-activations"]):
        _, blocked = gradients(translation_data, encoding, extra, state, device=device)
        assert_same_gradients(blocked, whole, extra)


@pytest.mark.parametrize("encoding,extra", BETWEEN_CASES + [("floater", ["--floater-recompute-every", "3"])],
                         ids=[n for n, _ in BETWEEN_CASES] + ["floater-K3"])
def test_a_backward_in_another_thread_recomputes_its_forward(translation_data, encoding, extra):
    """Autograd runs a CUDA backward in a thread of its own, and an encoding keeps its passes per thread:
    a checkpointed layer's recomputation there still replays its forward's pass (its terms, positions and
    FLOATER's table), here with the backward called from another thread."""
    def in_another_thread(loss):
        errors = []

        def backward():
            try:
                loss.backward()
            except Exception as error:  # (reported by the test, not lost in the thread)
                errors.append(error)
        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
        assert not errors, errors

    plain_model, plain = gradients(translation_data, encoding, extra)
    state = {k: v for k, v in plain_model.state_dict().items() if "window_" not in k}
    _, checkpointed = gradients(translation_data, encoding, [*extra, "--checkpoint-activations"], state,
                                backward=in_another_thread)
    assert_same_gradients(checkpointed, plain, encoding)


def test_offload_activations_alone_checkpoints_every_layer(masked_lm_data):
    """fairseq documents --offload-activations as 'Sets --checkpoint-activations'; its transformer and
    named LM sizes set it, but the `transformer_lm` architecture (its config's defaults) does not: given
    alone, every layer of ours is still checkpointed, offloading (not left plain)."""
    from test_lm import TINY_LM

    model, _, args = build_model(masked_lm_data, "transformer_lm_t5", [*TINY_LM, "--offload-activations"],
                                 task="language_modeling")
    assert not args.checkpoint_activations  # (what this case is: fairseq did not set it)
    assert len(model.decoder.layers) == 2
    for layer in model.decoder.layers:
        assert hasattr(layer, "precheckpoint_forward")
        assert layer.forward.args[1] is True  # (_checkpointed_forward's offload)


@pytest.mark.parametrize("flag", ["--checkpoint-activations", "--offload-activations"])
def test_checkpointed_layers_run_again_during_backward(translation_data, flag):
    """What the flags are for: a layer keeps no activations for backward and runs its forward again there.
    Each attention runs once per layer in the forward pass with or without the flag; backward runs it again
    only with it (never under no_grad, where nothing is saved)."""
    runs = {}
    for extra in ([], [flag]):
        torch.manual_seed(0)
        model, task, _ = build_model(translation_data, "transformer_floater", [*TINY_TRANSFORMER, *NO_DROPOUT, *extra])
        model.train()
        model.set_num_updates(0)
        layers = [*model.encoder.layers, *model.decoder.layers]
        calls = []
        for layer in layers:
            layer.self_attn.register_forward_hook(lambda *args: calls.append(1))
        src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=9, tgt_len=7)
        with torch.no_grad():
            model(src, src_lengths, prev)
        without_grad = len(calls)
        logits, _ = model(src, src_lengths, prev)
        forward = len(calls) - without_grad
        logits.float().log_softmax(-1)[..., 5].sum().backward()
        runs[bool(extra)] = (without_grad, forward, len(calls) - without_grad - forward)
    count = len(layers)
    assert runs == {False: (count, count, 0), True: (count, count, count)}
