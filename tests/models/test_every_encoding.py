"""Model-level behaviour, parametrised over every encoding the plugin registers: an encoding
added later is covered here without new test code."""

import argparse
import copy
import dataclasses

import pytest
import torch

import posenc_fairseq  # noqa: F401
from fairseq.models import ARCH_MODEL_REGISTRY
from posenc_fairseq.encodings import ENCODINGS, ModelDims, build_encoding
from posenc_fairseq.encodings.base import PROJECTION_HOOKS, RELATIVE_HOOKS, PositionalEncoding
from devices import bound, on
from util import (QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, HostReads, build_model, encoding_options,
                  random_batch, run_distributed)

EVERY_ENCODING = sorted(ENCODINGS)


FAMILIES = {"transformer": "PositionalTransformerModel", "transformer_lm": "PositionalLanguageModel",
            "roberta": "PositionalRobertaModel"}


def stock_sizes(family):
    """{fairseq's architecture of `family`'s model (its registry): our size suffix}, e.g.
    transformer_wmt_en_de -> _wmt_en_de; a name without the family's prefix (RoBERTa's `xlm`) -> _xlm."""
    return {arch: arch[len(family):] if arch.startswith(family) else f"_{arch}"
            for arch, model in ARCH_MODEL_REGISTRY.items() if model is ARCH_MODEL_REGISTRY[family]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_stock_size_is_registered_for_every_encoding(family):
    sizes = stock_sizes(family)
    assert "" in sizes.values() and len(sizes) >= 3
    for encoding in EVERY_ENCODING:
        for suffix in sizes.values():
            assert ARCH_MODEL_REGISTRY[f"{family}_{encoding}{suffix}"].__name__ == FAMILIES[family], (encoding, suffix)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_size_sets_the_options_stock_sets(family):
    """`{family}_floater{size}`'s architecture (FLOATER keeps the size's own input embedding, learned
    or sinusoidal), and that of the baseline named for that embedding, set what fairseq's
    `{family}{size}` sets, but this package's own options."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from posenc_fairseq.models.common import add_position_args

    probe = argparse.ArgumentParser()
    add_position_args(probe)
    ours_only = {action.dest for action in probe._actions}

    def architecture_sets(arch):
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        # then, as fairseq's config does for a model with a dataclass, its defaults for what is unset
        # (stock `transformer_lm` is that dataclass's no-op architecture; ours fill in the same)
        dataclass = getattr(ARCH_MODEL_REGISTRY[family], "__dataclass", None)
        for field in dataclasses.fields(dataclass) if dataclass is not None else ():
            if not hasattr(args, field.name) and field.default is not dataclasses.MISSING and \
                    not str(field.default).startswith("${"):
                setattr(args, field.name, field.default)
        return {key: value for key, value in vars(args).items() if key not in ours_only}

    for stock_arch, suffix in stock_sizes(family).items():
        stock = architecture_sets(stock_arch)
        # also the baseline named for the size's own input embedding (its flags written explicitly)
        named = "learned" if stock.get("encoder_learned_pos") or stock.get("decoder_learned_pos") else "sinusoidal"
        for encoding in ("floater", named):
            ours = architecture_sets(f"{family}_{encoding}{suffix}")
            differing = {key for key in ours.keys() | stock.keys()
                         if ours.get(key, "absent") != stock.get(key, "absent")}
            assert not differing, (encoding, suffix, {key: (ours.get(key, "absent"), stock.get(key, "absent"))
                                                      for key in differing})


def decoder_logits_full_and_stepwise(model, src, src_lengths, prev):
    encoder_out = model.encoder(src, src_lengths=src_lengths)
    full, _ = model.decoder(prev, encoder_out=encoder_out)
    state, steps = {}, []
    for t in range(prev.size(1)):
        logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        steps.append(logits)
    return full, torch.cat(steps, dim=1)


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_incremental_decoding_equals_full_forward(translation_data, device, encoding, dtype):
    """One token at a time (other kernels than the pass's on CUDA) equals the full pass in the model's
    dtype; half precision on CUDA only (devices.BOUNDS)."""
    limit = bound(device, "steps vs pass", dtype)
    model, task = perturbed_translation_model(translation_data, encoding, device)
    model.to(dtype)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7))
    with torch.no_grad():
        full, stepwise = decoder_logits_full_and_stepwise(model, src, src_lengths, prev)
    assert (full.float() - stepwise.float()).abs().max() <= limit


def perturbed_translation_model(data, encoding, device="cpu"):
    """Tiny transformer_{encoding} in eval mode with its encoding moved away from identity, on `device`."""
    torch.manual_seed(0)
    model, task, _ = build_model(data, f"transformer_{encoding}", TINY_TRANSFORMER)
    model.eval()
    perturb_away_from_identity(model)
    return model.to(device), task


def perturb_away_from_identity(model):
    """Encodings may start as 'adds nothing' (zero tables, zero last layer): move every
    encoding parameter so the test exercises the position terms themselves."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.positional_encoding.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))


#: every hook through which an encoding changes the attention
POSITION_HOOKS = PROJECTION_HOOKS + RELATIVE_HOOKS


def without_position_term(model):
    """A copy of `model` that has lost its position information: its encoding's hooks are the neutral
    defaults (they add nothing) and its stacks have no absolute position embedding (what a path that
    dropped the term would give)."""
    model = copy.deepcopy(model)
    encoding = model.positional_encoding
    for hook in POSITION_HOOKS:
        setattr(encoding, hook, getattr(PositionalEncoding, hook).__get__(encoding))
    for stack in (getattr(model, "encoder", None), model.decoder):
        if stack is not None:
            stack.embed_positions = None
    return model


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_position_information_changes_the_output_or_not(translation_data, encoding):
    """Swapping two source tokens changes the encoder output at other positions exactly when
    the architecture carries position information (transformer_nope must be order-blind)."""
    model, task = perturbed_translation_model(translation_data, encoding)
    src, src_lengths, _ = random_batch(task.source_dictionary, batch=1, src_len=8, tgt_len=2)
    swapped = src.clone()
    swapped[0, [1, 2]] = src[0, [2, 1]]
    with torch.no_grad():
        out = model.encoder(src, src_lengths=src_lengths)["encoder_out"][0]
        out_swapped = model.encoder(swapped, src_lengths=src_lengths)["encoder_out"][0]
    # token 5 is unchanged; without positions its representation cannot depend on the order
    difference = (out[5] - out_swapped[5]).abs().max().item()
    if encoding == "nope":
        assert difference <= 1e-5
    else:
        assert difference > 1e-4


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_runs_on_inputs_longer_than_training(translation_data, device, encoding):
    torch.manual_seed(0)
    extra = [*TINY_TRANSFORMER, "--max-source-positions", "64", "--max-target-positions", "64"]
    model, task, args = build_model(translation_data, f"transformer_{encoding}", extra)
    model.eval().to(device)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=1, src_len=1000, tgt_len=1000))
    if args.input_positions == "learned":
        with pytest.raises(ValueError, match="learned position table"):
            model(src, src_lengths, prev)
        return
    with torch.no_grad():
        logits, _ = model(src, src_lengths, prev)
    assert logits.shape[:2] == (1, 1000) and torch.isfinite(logits).all()


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_roberta_features_ignore_padding(masked_lm_data, device, encoding):
    torch.manual_seed(0)
    model, task, _ = build_model(masked_lm_data, f"roberta_{encoding}", TINY_ROBERTA, task="masked_lm")
    model.eval()
    perturb_away_from_identity(model)
    model.to(device)
    dictionary = task.source_dictionary
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (1, 10))
    tokens[0, 0], tokens[0, -1] = dictionary.bos(), dictionary.eos()
    padded = torch.cat([tokens, torch.full((1, 4), dictionary.pad())], dim=1)
    tokens, padded = on(device, tokens, padded)
    with torch.no_grad():
        features, _ = model(tokens, features_only=True)
        features_padded, _ = model(padded, features_only=True)
    assert (features - features_padded[:, :10]).abs().max() <= bound(device, "padding")



def owns_parameters(name):
    return any(True for _ in build_encoding(name, encoding_options(), ModelDims(32, 4, 2, 2)).parameters())


# Encodings without parameters of their own (ALiBi, rotary, the absolute baselines) train under DDP
# exactly as the stock model does; sinusoidal stands for them. Every encoding's parameters are
# checked for gradients (what DDP's unused-parameter check demands) in the next test.
DISTRIBUTED = sorted({name for name in EVERY_ENCODING if owns_parameters(name)} | {"sinusoidal"})


@pytest.mark.slow
@pytest.mark.parametrize("encoding", DISTRIBUTED)
def test_trains_in_two_gloo_processes_and_resumes(translation_data, tmp_path, encoding):
    command = ["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", f"transformer_{encoding}",
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--save-dir", tmp_path, "--disable-validation"]
    first = run_distributed(command + ["--max-update", "3"], world_size=2)
    assert "num_updates 3" in first
    resumed = run_distributed(command + ["--max-update", "5"], world_size=2)
    assert "Loaded checkpoint" in resumed and "num_updates 5" in resumed


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
@pytest.mark.parametrize("family,length", [("transformer", 6), ("roberta", 8), ("roberta", 1)])
def test_every_parameter_receives_a_gradient(translation_data, masked_lm_data, device, encoding, family, length):
    """What DDP's unused-parameter check (pytorch_ddp) demands; legacy_ddp would not notice. Also a batch
    of one-token rows, which has no distance but 0 (AT5's d > 0 side once got no gradient there)."""
    torch.manual_seed(0)
    if family == "transformer":
        model, task, _ = build_model(translation_data, f"transformer_{encoding}", TINY_TRANSFORMER)
    else:
        model, task, _ = build_model(masked_lm_data, f"roberta_{encoding}", TINY_ROBERTA, task="masked_lm")
    model.train()
    perturb_away_from_identity(model)  # a zero last layer would block the gradient behind it
    model.to(device)
    if family == "transformer":
        src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=2, src_len=length, tgt_len=5))
        output, _ = model(src, src_lengths, prev)
    else:
        tokens = torch.randint(task.source_dictionary.nspecial, len(task.source_dictionary), (2, length))
        output, _ = model(tokens.to(device))
    output.float().pow(2).mean().backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused


@pytest.mark.parametrize("encoding,options", [(name, ()) for name in EVERY_ENCODING] +
                         [("floater", ("--floater-recompute-every", "2"))])
def test_a_training_step_reads_from_the_device_only_where_stock_does(translation_data, device, encoding, options,
                                                                     monkeypatch):
    """On a GPU each read of a value by the host waits for the device. In three training steps (forward
    and backward; a left-padded source, target rows padded at both ends) the package's own code reads
    only in the stacks' padding check (`real_token_positions`: one per stack and the decoder's
    source, as fairseq's own checks do), and on the CPU the check of the thread's subnormal setting;
    every other read is fairseq's. (FLOATER: its table's overflow check is read by the next pass
    from host memory, and its rows come from the stacks' bounds. On CUDA it solves on the GPU, in its
    graphs: the default solve, on the CPU, copies h and b(0) to the host, which this test would count.)"""
    if torch.device(device).type == "cuda":
        monkeypatch.setenv("POSENC_FLOATER_CUDA_GRAPHS", "1")
    torch.manual_seed(0)
    model, task, _ = build_model(translation_data, f"transformer_{encoding}", [*TINY_TRANSFORMER, *options])
    model.train()
    perturb_away_from_identity(model)
    model.to(device)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    prev[0, 0], prev[1, -1] = task.target_dictionary.pad(), task.target_dictionary.pad()
    src, src_lengths, prev = on(device, src, src_lengths, prev)
    allowed = {("posenc_fairseq", "real_token_positions")} | (
        {("posenc_fairseq", "_flushing_subnormals")} if torch.device(device).type == "cpu" else set())
    for update in range(3):
        model.set_num_updates(update)
        with HostReads() as host:
            output, _ = model(src, src_lengths, prev)
            output.float().pow(2).mean().backward()
        ours = [read for read in host.reads if read[0] == "posenc_fairseq"]
        assert set(ours) <= allowed, (update, ours)
        assert ours.count(("posenc_fairseq", "real_token_positions")) == 3
        assert len(host.reads) > len(ours)  # (the counting sees fairseq's reads too)


def assert_half_precision_close(model, inputs, dtype, has_position_term=True):
    """`model` (fp32) converted to `dtype`: finite logits within devices.BOUNDS' "half logits" of fp32's
    (about twice the largest difference measured on the CPU over the encodings, here and in test_lm.py),
    a bound that the same model without its position term exceeds (it would catch a dropped term)."""
    with torch.no_grad():
        reference, _ = model(*inputs)
        dropped, _ = without_position_term(model)(*inputs)
        half, _ = model.to(dtype)(*inputs)
    limit = bound(reference.device, "half logits", dtype) * reference.abs().max()
    assert torch.isfinite(half).all()
    assert (half.float() - reference).abs().max() <= limit
    if has_position_term:
        assert (dropped - reference).abs().max() > limit


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_is_finite_and_close(translation_data, device, encoding, dtype):
    """Padded batch (left-padded source, causal decoder) in bf16/fp16: dtype-aware masks, no NaN,
    the logits as close to fp32's as the dtype's rounding allows."""
    model, task = perturbed_translation_model(translation_data, encoding, device)
    src, src_lengths, prev = on(device, *random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7))
    assert_half_precision_close(model, (src, src_lengths, prev), dtype, has_position_term=encoding != "nope")
