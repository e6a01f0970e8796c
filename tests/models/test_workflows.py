"""fairseq workflows beyond training and generation (issue 10), each run through fairseq's own code
path and parametrised over every registered encoding, compared with the stock architecture where a
comparison exists: --retain-dropout, --retain-dropout-modules, LayerDrop pruning
(--encoder/decoder-layers-to-keep), --cross-self-attention, unequal encoder/decoder sizes, head
pruning (AdaPrune), TorchScript (refused with one message) and --tensorboard-logdir."""
import copy
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import posenc_fairseq  # noqa: F401
from fairseq import checkpoint_utils, search
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.modules import FairseqDropout
from fairseq.sequence_generator import SequenceGenerator
from posenc_fairseq.attention import PositionalAttention
from posenc_fairseq.encodings import ENCODINGS
from posenc_fairseq.encodings.option_types import OptionValueError
from test_every_encoding import decoder_logits_full_and_stepwise as stepwise_and_full
from util import (QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, build_model, random_batch, run)

EVERY_ENCODING = sorted(ENCODINGS)


def perturbed(model):
    """Move every encoding parameter away from its (possibly zero, i.e. identity) init."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.positional_encoding.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


def translation_model(data, arch, extra=(), perturb=True):
    torch.manual_seed(0)
    model, task, args = build_model(data, arch, [*TINY_TRANSFORMER, *extra])
    model.eval()
    if perturb and hasattr(model, "positional_encoding"):
        perturbed(model)
    return model, task, args


def roberta_model(data, arch, extra=(), perturb=True):
    torch.manual_seed(0)
    model, task, args = build_model(data, arch, [*TINY_ROBERTA, *extra], task="masked_lm")
    model.eval()
    if perturb and hasattr(model, "positional_encoding"):
        perturbed(model)
    return model, task, args


def beam_search(model, task, src, src_lengths, beam=2):
    model.decoder.set_beam_size(beam)
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_b=8,
                                  search_strategy=search.BeamSearch(task.target_dictionary))
    with torch.no_grad():
        return generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": src_lengths}})


def generation_cfg(**options):
    """What fairseq-generate hands to `model.prepare_for_inference_` (cfg.generation.*)."""
    defaults = dict(retain_dropout=False, retain_dropout_modules=None, beam=5, no_beamable_mm=False,
                    print_alignment=False)
    return SimpleNamespace(generation=SimpleNamespace(**{**defaults, **options}))


# --- --retain-dropout --------------------------------------------------------------------------------
ATTENTION_DROPOUT_ONLY = ["--dropout", "0", "--activation-dropout", "0", "--attention-dropout", "0.5"]


@pytest.mark.parametrize("arch", ["transformer"] + [f"transformer_{name}" for name in EVERY_ENCODING])
def test_retain_dropout_applies_attention_dropout_at_inference(translation_data, arch):
    """Identity-initialised model, attention dropout only: with --retain-dropout (fairseq's
    prepare_for_inference_) encoder and decoder outputs vary run to run as stock's do (the encoder
    self-attention runs the SDPA fast path); without it they are deterministic."""
    model, task, _ = translation_model(translation_data, arch, ATTENTION_DROPOUT_ONLY, perturb=False)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=9, tgt_len=7)
    plain = copy.deepcopy(model)
    plain.prepare_for_inference_(generation_cfg())
    model.prepare_for_inference_(generation_cfg(retain_dropout=True))

    def twice(m):
        with torch.no_grad():
            encoder = [m.encoder(src, src_lengths=src_lengths)["encoder_out"][0] for _ in range(2)]
            decoder = [m(src, src_lengths, prev)[0] for _ in range(2)]
        return (encoder[0] - encoder[1]).abs().max(), (decoder[0] - decoder[1]).abs().max()

    assert max(twice(plain)) == 0
    encoder_change, decoder_change = twice(model)
    assert encoder_change > 1e-3 and decoder_change > 1e-3


def dropout_names(model):
    return Counter(m.module_name for m in model.modules() if isinstance(m, FairseqDropout))


@pytest.fixture(scope="module")
def stock_dropout_names(translation_data, masked_lm_data):
    transformer, _, _ = translation_model(translation_data, "transformer")
    roberta, _, _ = roberta_model(masked_lm_data, "roberta")
    return {"transformer": dropout_names(transformer), "roberta": dropout_names(roberta)}


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_retain_dropout_modules_uses_stock_class_names(translation_data, masked_lm_data, stock_dropout_names,
                                                       encoding):
    model, _, _ = translation_model(translation_data, f"transformer_{encoding}")
    roberta, _, _ = roberta_model(masked_lm_data, f"roberta_{encoding}")
    assert dropout_names(model) == stock_dropout_names["transformer"]
    assert dropout_names(roberta) == stock_dropout_names["roberta"]
    model.prepare_for_inference_(generation_cfg(retain_dropout=True, retain_dropout_modules=["TransformerEncoder"]))
    assert model.encoder.dropout_module.apply_during_inference
    assert not model.decoder.dropout_module.apply_during_inference
    roberta.prepare_for_inference_(generation_cfg(retain_dropout=True,
                                                  retain_dropout_modules=["MultiheadAttention"]))
    attentions = [m for m in roberta.modules() if isinstance(m, PositionalAttention)]
    assert attentions and all(m.dropout_module.apply_during_inference for m in attentions)
    assert not roberta.encoder.sentence_encoder.dropout_module.apply_during_inference


# --- LayerDrop pruning -------------------------------------------------------------------------------
def save_checkpoint(model, args, path):
    """A checkpoint as fairseq-train writes it (cfg + model), enough for fairseq's loaders."""
    torch.save({"cfg": convert_namespace_to_omegaconf(args), "args": None, "model": model.state_dict(),
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}],
                "extra_state": {"train_iterator": None}}, path)


def keep_layers(stack, layers):
    stack.layers = torch.nn.ModuleList([stack.layers[i] for i in layers])
    stack.num_layers = len(layers)


def original_key(key, kept):
    """The unpruned model's name of a pruned model's encoding key (`encoder1` -> `encoder2`, ...)."""
    def rename(part):
        match = re.match(r"^(encoder|decoder)(_?)(\d+)(_.*)?$", part)
        if not match:
            return part
        role, sep, layer, rest = match.groups()
        return f"{role}{sep}{kept[role][int(layer)]}{rest or ''}"
    return ".".join(rename(part) for part in key.split("."))


#: encodings (and options) whose math depends on a layer's depth, not only on its parameters
DEPTH_DEFINED = {"lfhc": [], "t5": ["--scalar-bias-layers", "first"], "at5_nob": ["--scalar-bias-layers", "first"],
                 "floater": ["--floater-first-block-only"]}


def assert_pruned_is_the_full_model_with_the_kept_layers(pruned, model, task, kept):
    """Every per-layer encoding parameter of `pruned` is the one of the layer of `model` it followed
    (`kept`: {stack: kept layer indices}), and `pruned` computes what `model` with only those layers
    does (`model` is cut down to them)."""
    full_state = model.positional_encoding.state_dict()
    for key, value in pruned.positional_encoding.state_dict().items():
        if key.endswith("cache"):  # FLOATER's table: solved again for the kept layers
            continue
        assert torch.equal(value, full_state[original_key(key, kept)]), key
    keep_layers(model.encoder, kept["encoder"])
    keep_layers(model.decoder, kept["decoder"])
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    with torch.no_grad():
        assert (pruned(src, src_lengths, prev)[0] - model(src, src_lengths, prev)[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_layerdrop_pruning_keeps_each_layers_own_position_parameters(translation_data, tmp_path, encoding):
    """fairseq's load_model_ensemble with --encoder-layers-to-keep 0,2 --decoder-layers-to-keep 1,2
    (what fairseq-generate --model-overrides does) on a 3+3-layer checkpoint equals the full model
    with those layers removed, each kept layer with its own position parameters (LFHC: a prefix of
    the encoder's layers, which keeps every depth; see the refusals below)."""
    extra = ["--encoder-layers", "3", "--decoder-layers", "3", "--scalar-bias-layers", "all"]
    model, task, args = translation_model(translation_data, f"transformer_{encoding}", extra)
    save_checkpoint(model, args, tmp_path / "full.pt")
    kept = {"encoder": [0, 1] if encoding == "lfhc" else [0, 2], "decoder": [0, 1] if encoding == "lfhc" else [1, 2]}
    (pruned,), _ = checkpoint_utils.load_model_ensemble(
        [str(tmp_path / "full.pt")], arg_overrides={f"{role}_layers_to_keep": ",".join(map(str, layers))
                                                    for role, layers in kept.items()})
    pruned.eval()
    assert len(pruned.encoder.layers) == 2 and len(pruned.decoder.layers) == 2
    assert_pruned_is_the_full_model_with_the_kept_layers(pruned, model, task, kept)


@pytest.mark.parametrize("encoding", ["shaw", "t5", "xl"])
def test_layerdrop_pruning_reads_the_kept_layers_in_any_order(translation_data, tmp_path, encoding):
    """fairseq's prune_state_dict sorts --encoder/decoder-layers-to-keep ("2,0" keeps layers 0 and 2, in
    that order): the encoding's per-layer parameters follow the same layers, so the model equals the
    full one with those layers removed, as with the list in order."""
    extra = ["--encoder-layers", "3", "--decoder-layers", "3", "--scalar-bias-layers", "all"]
    model, task, args = translation_model(translation_data, f"transformer_{encoding}", extra)
    save_checkpoint(model, args, tmp_path / "full.pt")
    (pruned,), _ = checkpoint_utils.load_model_ensemble(
        [str(tmp_path / "full.pt")], arg_overrides={"encoder_layers_to_keep": "2,0", "decoder_layers_to_keep": "2,1"})
    pruned.eval()
    kept = {"encoder": [0, 2], "decoder": [1, 2]}
    assert_pruned_is_the_full_model_with_the_kept_layers(pruned, model, task, kept)


@pytest.mark.parametrize("encoding", sorted(DEPTH_DEFINED))
def test_layerdrop_pruning_that_would_change_a_layers_depth_is_refused(translation_data, tmp_path, encoding):
    """LFHC's l, a bias in the first layer only, FLOATER's first block only: defined by a layer's depth,
    not by its parameters. Pruning that moves such a layer (LFHC: a layer to another depth; the others:
    dropping layer 0) would give a model that was never trained, so it is refused; a pruning that moves
    nothing of the kind loads."""
    extra = ["--encoder-layers", "3", "--decoder-layers", "3", *DEPTH_DEFINED[encoding]]
    model, _, args = translation_model(translation_data, f"transformer_{encoding}", extra)
    save_checkpoint(model, args, tmp_path / "full.pt")
    with pytest.raises(OptionValueError, match=r"^--encoder-layers-to-keep 1,2: .* a model it was not trained as"):
        checkpoint_utils.load_model_ensemble([str(tmp_path / "full.pt")], arg_overrides={"encoder_layers_to_keep": "1,2"})
    # (both stacks: fairseq's prune_state_dict drops every layer of a stack without a list)
    (pruned,), _ = checkpoint_utils.load_model_ensemble(
        [str(tmp_path / "full.pt")], arg_overrides={"encoder_layers_to_keep": "0,1", "decoder_layers_to_keep": "0,2"
                                                    if encoding != "lfhc" else "0,1"})
    assert len(pruned.encoder.layers) == len(pruned.decoder.layers) == 2


@pytest.mark.parametrize("family", ["transformer", "roberta"])
def test_layerdrop_binds_every_layer_at_its_own_index(translation_data, masked_lm_data, family):
    """With --encoder/decoder-layerdrop the layers are a LayerDropModuleList, which skips layers at
    random when iterated in training mode, the mode a model is built in: every layer is still bound,
    self- and cross-attention, at its own index, whatever the random state."""
    for seed in range(4):
        torch.manual_seed(seed)
        if family == "transformer":
            extra = ["--encoder-layers", "4", "--decoder-layers", "4", "--encoder-layerdrop", "0.5",
                     "--decoder-layerdrop", "0.5"]
            model, _, _ = build_model(translation_data, "transformer_shaw", [*TINY_TRANSFORMER, *extra])
            stacks = {"encoder": model.encoder, "decoder": model.decoder}
        else:
            extra = ["--encoder-layers", "4", "--encoder-layerdrop", "0.5"]
            model, _, _ = build_model(masked_lm_data, "roberta_shaw", [*TINY_ROBERTA, *extra], task="masked_lm")
            stacks = {"encoder": model.encoder.sentence_encoder}
        for role, stack in stacks.items():
            layers = [stack.layers[index] for index in range(len(stack.layers))]
            assert len(layers) == 4
            bound = [(layer.self_attn.position_binding.role, layer.self_attn.position_binding.layer)
                     if layer.self_attn.position_binding is not None else None for layer in layers]
            assert bound == [(role, index) for index in range(4)], (seed, role, bound)
            if role == "decoder":
                assert [layer.encoder_attn.position_binding.layer for layer in layers] == list(range(4))


@pytest.mark.parametrize("encoding", ["shaw", "t5", "floater"])
def test_layerdrop_pruning_roberta(masked_lm_data, tmp_path, encoding):
    extra = ["--encoder-layers", "3", "--scalar-bias-layers", "all"]
    model, task, args = roberta_model(masked_lm_data, f"roberta_{encoding}", extra)
    save_checkpoint(model, args, tmp_path / "full.pt")
    (pruned,), _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "full.pt")],
                                                        arg_overrides={"encoder_layers_to_keep": "1,2"})
    pruned.eval()
    keep_layers(model.encoder.sentence_encoder, [1, 2])
    tokens = torch.randint(task.source_dictionary.nspecial, len(task.source_dictionary), (2, 9))
    with torch.no_grad():
        assert (pruned(tokens)[0] - model(tokens)[0]).abs().max() <= 1e-5


# --- --cross-self-attention --------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_cross_self_attention(translation_data, encoding):
    """Decoder self-attention over cat(source, target): step-by-step decoding equals the full pass,
    the result does not depend on how much the source is padded, and beam search runs."""
    model, task, _ = translation_model(translation_data, f"transformer_{encoding}", ["--cross-self-attention"])
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    with torch.no_grad():
        full, stepwise = stepwise_and_full(model, src, src_lengths, prev)
        assert (full - stepwise).abs().max() <= 1e-5
        # the shortest sentence alone (no padding) gives what it gave inside the padded batch
        length = int(src_lengths[-1])
        alone, _ = model(src[-1:, -length:], src_lengths[-1:], prev[-1:])
        assert (alone[0] - full[-1]).abs().max() <= 1e-5
    hypotheses = beam_search(model, task, src, src_lengths)
    assert len(hypotheses) == 3 and all(len(h) == 2 for h in hypotheses)


def test_cross_self_attention_sinusoidal_is_the_stock_transformer(translation_data):
    stock, task, _ = translation_model(translation_data, "transformer", ["--cross-self-attention"])
    ours, _, _ = translation_model(translation_data, "transformer_sinusoidal", ["--cross-self-attention"])
    ours.load_state_dict(stock.state_dict())
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    with torch.no_grad():
        assert (stock(src, src_lengths, prev)[0] - ours(src, src_lengths, prev)[0]).abs().max() <= 1e-5
    for a, b in zip(beam_search(stock, task, src, src_lengths), beam_search(ours, task, src, src_lengths)):
        assert [h["tokens"].tolist() for h in a] == [h["tokens"].tolist() for h in b]


# --- different encoder and decoder sizes -------------------------------------------------------------
UNEQUAL = ["--decoder-embed-dim", "48", "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "64"]


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_unequal_encoder_and_decoder_sizes(translation_data, encoding):
    model, task, _ = translation_model(translation_data, f"transformer_{encoding}", UNEQUAL)
    encoding_module = model.positional_encoding
    parts = {"encoder": encoding_module.encoder, "decoder": encoding_module.decoder}
    assert (parts["encoder"].dims.embed_dim, parts["encoder"].dims.heads) == (32, 4)
    assert (parts["decoder"].dims.embed_dim, parts["decoder"].dims.heads) == (48, 2)
    for layer in model.decoder.layers:
        assert layer.self_attn.position_binding.encoding is parts["decoder"]
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    with torch.no_grad():
        full, stepwise = stepwise_and_full(model, src, src_lengths, prev)
    assert (full - stepwise).abs().max() <= 1e-5
    model.train()
    output, _ = model(src, src_lengths, prev)
    output.pow(2).mean().backward()
    assert not [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def test_unequal_sizes_floater_train_dynamics_only_trains_both_parts(translation_data):
    model, _, _ = translation_model(translation_data, "transformer_floater", [*UNEQUAL, "--floater-train-dynamics-only"])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"positional_encoding.{part}.dynamics.{layer}.{kind}" for part in ("encoder", "decoder")
                         for layer in ("fc1", "fc2") for kind in ("weight", "bias")}


def test_unequal_sizes_sinusoidal_is_the_stock_transformer(translation_data):
    stock, task, _ = translation_model(translation_data, "transformer", UNEQUAL)
    ours, _, _ = translation_model(translation_data, "transformer_sinusoidal", UNEQUAL)
    ours.load_state_dict(stock.state_dict())
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7)
    with torch.no_grad():
        assert (stock(src, src_lengths, prev)[0] - ours(src, src_lengths, prev)[0]).abs().max() <= 1e-5


# --- values kept across passes in inference, after fairseq's optimizer ------------------------------
@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_inference_after_a_fairseq_adam_update_equals_a_fresh_model(translation_data, encoding):
    """fairseq's Adam writes the parameters through p.data, which no in-place version counter sees
    (as in fairseq-train's validation after updates): what an encoding keeps across passes in
    inference (T5/AT5 distance biases, XL/GCDF projected priors and u/v, FLOATER's table) must still
    follow. Evaluate (full pass and decoding steps), take one update with fairseq's own optimizer,
    evaluate again: equal to a fresh model loaded with the updated parameters."""
    from fairseq.optim.adam import FairseqAdam

    model, task, args = translation_model(translation_data, f"transformer_{encoding}")
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=8, tgt_len=6)
    with torch.no_grad():
        before = stepwise_and_full(model, src, src_lengths, prev)
    model.train()
    model(src, src_lengths, prev)[0].logsumexp(-1).mean().backward()
    config = SimpleNamespace(lr=[0.05], adam_betas="(0.9, 0.999)", adam_eps=1e-8, weight_decay=0.0,
                             fp16_adam_stats=False, tpu=False)
    optimizer = FairseqAdam(config, [p for p in model.parameters() if p.requires_grad])
    versions = [p._version for p in model.parameters()]
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions  # (what makes the case: no version moved)
    model.eval()
    fresh, _, _ = translation_model(translation_data, f"transformer_{encoding}", perturb=False)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after, expected = stepwise_and_full(model, src, src_lengths, prev), stepwise_and_full(fresh, src, src_lengths, prev)
    assert (after[0] - before[0]).abs().max() > 1e-3  # the update moved the outputs
    for got, want in zip(after, expected):  # full pass, then decoding steps
        assert torch.equal(got, want)


# --- head pruning (AdaPrune, trainer --mha-heads-to-keep) --------------------------------------------
def prune_heads(model, keep):
    """What fairseq's trainer does for --mha-heads-to-keep, layer by layer; returns the kept heads."""
    kept = []
    for layer in model.encoder.sentence_encoder.layers:
        attention = layer.self_attn
        reserve = attention._get_reserve_head_index(num_heads_to_keep=keep)
        kept.append([start // attention.head_dim for start, _ in reserve])
        attention._adaptive_prune_heads(reserve_head_index=reserve)
        attention._set_skip_embed_dim_check()
    return kept


def silence_pruned_heads(reference, kept):
    """The unpruned `reference` made to compute what pruning to the heads `kept` (per layer) leaves:
    the other heads' out_proj columns zeroed."""
    with torch.no_grad():
        for heads, layer in zip(kept, reference.encoder.sentence_encoder.layers):
            d = layer.self_attn.head_dim
            for head in set(range(layer.self_attn.num_heads)) - set(heads):
                layer.self_attn.out_proj.weight[:, head * d:(head + 1) * d] = 0


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_head_pruning_then_forward(masked_lm_data, encoding):
    """After fairseq's _adaptive_prune_heads the model equals the unpruned one whose pruned heads
    are silenced (their out_proj columns zeroed): every kept head keeps its own per-head position
    terms. Loading the pruned state into a model pruned before loading (the trainer's order) too."""
    model, task, _ = roberta_model(masked_lm_data, f"roberta_{encoding}")
    reference, kept = copy.deepcopy(model), prune_heads(model, keep=2)
    silence_pruned_heads(reference, kept)
    tokens = torch.randint(task.source_dictionary.nspecial, len(task.source_dictionary), (2, 9))
    with torch.no_grad():
        pruned_out = model(tokens)[0]
        assert (pruned_out - reference(tokens)[0]).abs().max() <= 1e-5
    fresh, _, _ = roberta_model(masked_lm_data, f"roberta_{encoding}", perturb=False)
    torch.manual_seed(5)
    with torch.no_grad():  # another init: the fresh model's own pruning picks other heads
        for parameter in fresh.parameters():
            parameter.normal_()
    prune_heads(fresh, keep=2)
    fresh.load_state_dict(model.state_dict())
    fresh.eval()
    with torch.no_grad():
        assert (fresh(tokens)[0] - pruned_out).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", ["floater", "rotary"])
def test_head_pruning_keeps_the_kept_heads_projection_biases(masked_lm_data, encoding):
    """RoBERTa's init zeroes the projection biases, so the test above cannot tell a kept head's own
    bias from none: with nonzero q/k/v biases (as after training) the pruned model still equals the
    unpruned one with the pruned heads silenced. FLOATER solves from the full-size biases b(0), the
    kept heads' entries being the live parameter (`full_projection_bias`)."""
    model, task, _ = roberta_model(masked_lm_data, f"roberta_{encoding}")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.encoder.sentence_encoder.layers:
            for which in "qkv":
                bias = getattr(layer.self_attn, f"{which}_proj").bias
                bias.copy_(0.5 * torch.randn(bias.shape, generator=generator))
    reference, kept = copy.deepcopy(model), prune_heads(model, keep=2)
    silence_pruned_heads(reference, kept)
    tokens = torch.randint(task.source_dictionary.nspecial, len(task.source_dictionary), (2, 9))
    with torch.no_grad():
        expected = reference(tokens)[0]
        assert (model(tokens)[0] - expected).abs().max() <= 1e-5
        # (not vacuous: the biases change the output)
        for layer in reference.encoder.sentence_encoder.layers:
            for which in "qkv":
                getattr(layer.self_attn, f"{which}_proj").bias.zero_()
        assert (reference(tokens)[0] - expected).abs().max() > 1e-3


# --- TorchScript -------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_torchscript_is_refused_with_one_message(translation_data, encoding):
    model, task, _ = translation_model(translation_data, f"transformer_{encoding}")
    with pytest.raises(RuntimeError, match="cannot be compiled with TorchScript"):
        torch.jit.script(model)
    with pytest.raises(RuntimeError, match="cannot be compiled with TorchScript"):
        torch.jit.script(SequenceGenerator([model], task.target_dictionary, beam_size=2))


@pytest.mark.parametrize("encoding", ["alibi", "rotary"])
def test_torch_compile_works(translation_data, encoding):
    """What README points to instead: torch.compile (graph capture; aot_eager needs no compiler)."""
    model, task, _ = translation_model(translation_data, f"transformer_{encoding}")
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=9, tgt_len=7)
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        assert (compiled(src, src_lengths, prev)[0] - model(src, src_lengths, prev)[0]).abs().max() <= 1e-5


# --- CLI: LayerDrop training, --tensorboard-logdir, pruned fairseq-generate ---------------------------
def test_cli_layerdrop_tensorboard_and_pruned_generate(translation_data, tmp_path):
    logdir = tmp_path / "tb"
    run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", "transformer_shaw",
         *TINY_TRANSFORMER, "--encoder-layers", "3", "--decoder-layers", "3", "--encoder-layerdrop", "0.3",
         "--decoder-layerdrop", "0.3", *QUICK_TRAIN, "--max-update", "2", "--save-dir", tmp_path / "ckpt",
         "--tensorboard-logdir", logdir])
    assert list(logdir.rglob("events.out.tfevents.*"))
    out = run(["fairseq-generate", translation_data, "--user-dir", USER_DIR, "--path", tmp_path / "ckpt" /
               "checkpoint_last.pt", "--beam", "2", "--max-len-b", "10", "--batch-size", "32", "--cpu",
               "--model-overrides", "{'encoder_layers_to_keep': '0,2', 'decoder_layers_to_keep': '1'}"])
    assert out.count("\nH-") == 20


# --- fairseq-generate's search options, prefixes, alignments, ensembles ------------------------------
GENERATION_OPTIONS = {
    "beam": dict(beam=3),
    "sampling_topk": dict(beam=2, sampling=True, sampling_topk=3),
    "sampling_topp": dict(beam=2, sampling=True, sampling_topp=0.9),
    "diverse_beam": dict(beam=2, diverse_beam_groups=2),
    "diverse_siblings": dict(beam=2, diversity_rate=0.5),
    "no_repeat_ngram": dict(beam=2, no_repeat_ngram_size=2),
    "alignment": dict(beam=2, print_alignment="hard"),
}


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_generation_options_prefixes_alignments_ensembles(translation_data, encoding):
    """The generators fairseq-generate builds (task.build_generator from its options), a forced
    prefix and a two-model ensemble, on an untrained tiny model: every sentence gets its hypotheses."""
    import argparse

    model, task, _ = translation_model(translation_data, f"transformer_{encoding}")
    other, _, _ = translation_model(translation_data, f"transformer_{encoding}")
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.01)
    src, src_lengths, _ = random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=2)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}, "id": torch.arange(3),
              "target": src.clone()}
    for name, options in GENERATION_OPTIONS.items():
        args = argparse.Namespace(max_len_b=8, **options)
        for candidate in (model, other):
            candidate.prepare_for_inference_(generation_cfg(beam=options["beam"],
                                                            print_alignment=bool(options.get("print_alignment"))))
        models = [model, other] if name == "beam" else [model]  # "beam": an ensemble of two models
        generator = task.build_generator(models, args)
        torch.manual_seed(0)
        hypotheses = task.inference_step(generator, models, sample)
        assert len(hypotheses) == 3, name
        for hypos in hypotheses:
            assert len(hypos) == options["beam"] and all(torch.isfinite(h["score"]) for h in hypos), name
            # (no_repeat_ngram: runs; on CPU fairseq-fixed's NGramRepeatBlock reads the whole token
            # buffer instead of the tokens so far and blocks nothing, for the stock transformer too)
            if name == "alignment":
                assert hypos[0]["alignment"] is not None
    prefix = torch.full((3, 2), task.target_dictionary.nspecial + 1)
    generator = task.build_generator([model], argparse.Namespace(beam=2, max_len_b=8))
    for hypos in task.inference_step(generator, [model], sample, prefix_tokens=prefix):
        assert all(h["tokens"][:2].tolist() == prefix[0].tolist() for h in hypos)
