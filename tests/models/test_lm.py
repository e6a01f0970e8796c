"""Decoder-only language models `transformer_lm_NAME` (models/lm.py), parametrised over every
registered encoding: registration of every fairseq LM size, step-by-step == full forward, padding,
order sensitivity, long input, gradients, half precision, LayerDrop pruning, fairseq-eval-lm's
--context-window batches, conversion from a stock transformer_lm checkpoint, the hub interface and
2-process DDP."""
import argparse
import os
import shutil
import subprocess
import sys

import pytest
import torch

import posenc_fairseq  # noqa: F401
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.models.transformer_lm import TransformerLanguageModelConfig
from posenc_fairseq import convert
from posenc_fairseq.encodings import ENCODINGS
from posenc_fairseq.encodings.positions import tensor_of
from posenc_fairseq.models.lm import SIZES, PositionalLanguageModel
from test_every_encoding import assert_half_precision_close
from util import QUICK_TRAIN, REPO, USER_DIR, build_model, built_once, run, run_distributed

EVERY_ENCODING = sorted(ENCODINGS)
TINY_LM = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-input-dim", "32",
           "--decoder-output-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
           "--tokens-per-sample", "64"]
LM_TASK = ["--task", "language_modeling", "--sample-break-mode", "none"]
NO_IDENTITY = {"alibi", "rotary"}  # parameter-free: conversion must refuse them (see test_convert.py)
# for the CLI-level DDP test (4 process launches each): FLOATER (model-bound dynamics) and LFHC
# (per-layer key/value tables); every encoding's parameters all get a gradient (tested per encoding)
DDP_ENCODINGS = ["floater", "lfhc"]


def perturb_away_from_identity(model, scale=0.1):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.positional_encoding.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def lm_model(data, encoding, *extra, perturb=True):
    """Tiny transformer_lm_{encoding} in eval mode, its encoding moved away from identity."""
    torch.manual_seed(0)
    model, task, args = build_model(data, f"transformer_lm_{encoding}", [*TINY_LM, *extra], task="language_modeling")
    model.eval()
    if perturb:
        perturb_away_from_identity(model)
    return model, task, args


def random_tokens(dictionary, batch=3, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=generator)


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_every_lm_size_is_registered_with_stock_sizes(encoding):
    for suffix in SIZES:
        name = f"transformer_lm_{encoding}{suffix}"
        assert ARCH_MODEL_REGISTRY[name] is PositionalLanguageModel
        ours = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[name](ours)
        if suffix:
            stock = argparse.Namespace()
            ARCH_CONFIG_REGISTRY[f"transformer_lm{suffix}"](stock)
        else:  # fairseq's `transformer_lm` is its config dataclass's defaults (a no-op architecture)
            stock = TransformerLanguageModelConfig()
        for key in ("decoder_layers", "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads",
                    "decoder_input_dim", "decoder_output_dim", "decoder_normalize_before", "no_decoder_final_norm",
                    "adaptive_input", "dropout", "activation_fn", "share_decoder_input_output_embed"):
            assert getattr(ours, key) == getattr(stock, key), (name, key)
        assert ours.positional_encoding == encoding
    # fairseq's own transformer_lm names still build fairseq's model
    assert ARCH_MODEL_REGISTRY["transformer_lm_gpt2_small"].__name__ == "TransformerLanguageModel"


@pytest.mark.parametrize("size", ["", "_gpt2_tiny"])
def test_sinusoidal_lm_equals_stock_transformer_lm_at_init(masked_lm_data, size):
    """transformer_lm_sinusoidal{size} is fairseq's transformer_lm{size}: same parameters from the same
    seed (fairseq's own build, only the decoder class swapped) and the same outputs."""
    torch.manual_seed(0)
    ours, task, _ = build_model(masked_lm_data, f"transformer_lm_sinusoidal{size}", TINY_LM, task="language_modeling")
    torch.manual_seed(0)
    stock, _, _ = build_model(masked_lm_data, f"transformer_lm{size}", TINY_LM, task="language_modeling")
    assert type(stock).__name__ == "TransformerLanguageModel"
    stock_state = stock.state_dict()  # (ours also has its encoding's entries)
    ours_state = {key: value for key, value in ours.state_dict().items() if not key.startswith("positional_encoding.")}
    assert ours_state.keys() == stock_state.keys()
    assert all(torch.equal(ours_state[key], stock_state[key]) for key in stock_state)
    tokens = random_tokens(task.source_dictionary, batch=2, length=9)
    tokens[1, 6:] = task.source_dictionary.pad()
    with torch.no_grad():
        assert (ours.eval()(tokens)[0] - stock.eval()(tokens)[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_a_named_size_builds_with_its_stock_shape(masked_lm_data, encoding):
    """transformer_lm_NAME_gpt2_tiny (fairseq's smallest named size: pre-norm, GELU, 2 x 64 dims,
    1 head) builds with fairseq's shape and decodes step by step as in one pass."""
    torch.manual_seed(0)
    model, task, args = build_model(masked_lm_data, f"transformer_lm_{encoding}_gpt2_tiny",
                                    ["--tokens-per-sample", "64"], task="language_modeling")
    model.eval()
    perturb_away_from_identity(model)
    assert (args.decoder_layers, args.decoder_embed_dim, args.decoder_attention_heads) == (2, 64, 1)
    assert args.decoder_normalize_before and args.activation_fn == "gelu"
    tokens = random_tokens(task.source_dictionary, batch=2, length=6)
    with torch.no_grad():
        full, stepwise = logits_full_and_stepwise(model, tokens)
    assert (full - stepwise).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_lm_has_no_encoder_and_no_cross_attention(masked_lm_data, encoding):
    model, _, _ = lm_model(masked_lm_data, encoding, perturb=False)
    assert type(model.decoder).__name__ == "PositionalTransformerDecoder"
    for layer in model.decoder.layers:
        assert layer.encoder_attn is None
        binding = layer.self_attn.position_binding
        assert binding.role == "decoder" and binding.encoding is model.decoder.encoding
    assert model.positional_encoding.dims.encoder_layers == 0
    assert model.positional_encoding.dims.decoder_layers == 2


def logits_full_and_stepwise(model, tokens):
    full, _ = model(tokens)
    state, steps = {}, []
    for t in range(tokens.size(1)):
        logits, _ = model(tokens[:, : t + 1], incremental_state=state)
        steps.append(logits)
    return full, torch.cat(steps, dim=1)


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_stepwise_decoding_equals_full_forward(masked_lm_data, encoding):
    model, task, _ = lm_model(masked_lm_data, encoding)
    tokens = random_tokens(task.source_dictionary, batch=3, length=9)
    tokens[:, 0] = task.source_dictionary.eos()  # what generation starts from
    with torch.no_grad():
        full, stepwise = logits_full_and_stepwise(model, tokens)
    assert (full - stepwise).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_right_padding_leaves_real_tokens_unchanged(masked_lm_data, encoding):
    """The language_modeling task right-pads the last block (and eval-lm's context windows)."""
    model, task, _ = lm_model(masked_lm_data, encoding)
    dictionary = task.source_dictionary
    tokens = random_tokens(dictionary, batch=1, length=10)
    padded = torch.cat([tokens, torch.full((1, 5), dictionary.pad())], dim=1)
    with torch.no_grad():
        alone, _ = model(tokens)
        batched, _ = model(padded)
    assert (alone - batched[:, :10]).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_order_of_the_context_matters_except_without_positions(masked_lm_data, encoding):
    """Swapping two earlier tokens changes the prediction at a later token exactly when the
    model carries position information. One layer: with more, the causal mask alone leaks order
    (a token's state depends on its own prefix), the known NoPE effect. float64: AT5's terms are
    small at these distances and must not drown in float32 rounding."""
    model, task, _ = lm_model(masked_lm_data, encoding, "--decoder-layers", "1")
    model.double()
    tokens = random_tokens(task.source_dictionary, batch=1, length=8)
    swapped = tokens.clone()
    swapped[0, [1, 2]] = tokens[0, [2, 1]]
    with torch.no_grad():
        out, _ = model(tokens)
        out_swapped, _ = model(swapped)
    difference = (out[0, 5] - out_swapped[0, 5]).abs().max().item()
    if encoding == "nope":
        assert difference <= 1e-10
    else:
        assert difference > 1e-7


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_runs_on_inputs_longer_than_training(masked_lm_data, encoding):
    model, task, args = lm_model(masked_lm_data, encoding, perturb=False)  # --tokens-per-sample 64
    assert args.max_target_positions == 64
    tokens = random_tokens(task.source_dictionary, batch=1, length=1000)
    if args.input_positions == "learned":
        with pytest.raises(ValueError, match="learned position table"):
            model(tokens)
        return
    with torch.no_grad():
        logits, _ = model(tokens)
    assert logits.shape[:2] == (1, 1000) and torch.isfinite(logits).all()


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_every_parameter_receives_a_gradient(masked_lm_data, encoding):
    model, task, _ = lm_model(masked_lm_data, encoding)
    model.train()
    output, _ = model(random_tokens(task.source_dictionary, batch=2, length=8))
    output.float().pow(2).mean().backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_is_finite_and_close(masked_lm_data, encoding, dtype):
    model, task, _ = lm_model(masked_lm_data, encoding)
    tokens = random_tokens(task.source_dictionary, batch=2, length=9)
    tokens[1, 6:] = task.source_dictionary.pad()
    # AT5's buckets 1 - exp(-gamma d / L) are all near 0 over 9 causal distances: its term hardly
    # moves this language model's logits (it does the translation model's: test_every_encoding.py)
    assert_half_precision_close(model, (tokens,), dtype, has_position_term=encoding not in ("nope", "at5", "at5_nob"))


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_decoder_layers_to_keep_prunes_the_encoding_with_its_layers(masked_lm_data, encoding):
    """--decoder-layers-to-keep 1 (LayerDrop pruning at load, models/common.py's
    EncodingStateMixin): a 2-layer language model's state dict loads strictly into the pruned one.
    (Layer 0 where the encoding defines something by depth: LFHC's l, the bias of T5/AT5's first layer;
    moving those is refused, test_workflows.py.)"""
    full, task, _ = lm_model(masked_lm_data, encoding)
    kept = "0" if encoding in ("lfhc", "t5", "t5_nob", "at5", "at5_nob") else "1"
    pruned, _, pruned_args = lm_model(masked_lm_data, encoding, "--decoder-layers-to-keep", kept, perturb=False)
    pruned_args._name = pruned_args.arch
    pruned.load_state_dict(full.state_dict(), strict=True, model_cfg=pruned_args)
    assert len(pruned.decoder.layers) == 1
    with torch.no_grad():
        assert torch.isfinite(pruned(random_tokens(task.source_dictionary, batch=2, length=7))[0]).all()


# ------------------------------------------------------------------ fairseq-eval-lm --context-window
@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_context_window_batches_score_each_window_from_position_0(masked_lm_data, encoding):
    """fairseq-eval-lm --context-window C feeds overlapping windows: up to C tokens of context, then
    the scored block, right-padded into a batch. Each window must be scored as if it were fed alone
    (its tokens at positions 0, 1, ...), and fairseq's eval_lm must report exactly those scores."""
    from fairseq_cli.eval_lm import eval_lm

    model, task, _ = lm_model(masked_lm_data, encoding, "--tokens-per-sample", "24")
    context, block = 16, 8
    task.args.tokens_per_sample = block  # what fairseq-eval-lm does: tokens_per_sample -= context_window
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    pad = task.source_dictionary.pad()

    def batches():
        return task.eval_lm_dataloader(dataset, batch_size=3, context_window=context, num_workers=0)

    total, count, windows_with_context = 0.0, 0, 0
    encoding_module = model.positional_encoding
    with torch.no_grad():
        for sample in batches():
            tokens, target = sample["net_input"]["src_tokens"], sample["target"]
            batched = torch.log_softmax(model(tokens)[0].float(), dim=-1)
            seen = tensor_of(encoding_module.contexts["decoder"].positions)
            for row in range(tokens.size(0)):
                real = tokens[row].ne(pad)
                length = int(real.sum())
                assert real[:length].all()  # windows are right-padded: context, block, pads
                assert torch.equal(seen[row, :length], torch.arange(length))  # each window starts at 0
                windows_with_context += sample["start_indices"][row] > 0
                alone = torch.log_softmax(model(tokens[row: row + 1, :length])[0].float(), dim=-1)[0]
                scored = target[row, :length].ne(pad)
                picked = alone[scored].gather(-1, target[row, :length][scored].unsqueeze(-1))
                picked_batched = batched[row, :length][scored].gather(-1, target[row, :length][scored].unsqueeze(-1))
                assert (picked - picked_batched).abs().max() <= 1e-4
                total += picked.sum().item()
                count += picked.numel()
    assert windows_with_context > 0 and count > 0
    expected = -total / count / torch.log(torch.tensor(2.0)).item()
    result = eval_lm([model], task.source_dictionary, batches(), target_dictionary=task.target_dictionary,
                     device=torch.device("cpu"))
    assert abs(float(result["loss"]) - expected) <= 1e-4


# ------------------------------------------------------------------ conversion, hub, DDP
@pytest.fixture(scope="module")
def stock_lm(masked_lm_data, tmp_path_factory):
    """A tiny transformer_lm trained for 2 updates with STOCK fairseq, as a hub folder."""
    def build(save):
        run(["fairseq-train", masked_lm_data, *LM_TASK, "--arch", "transformer_lm", *TINY_LM, *QUICK_TRAIN,
             "--max-update", "2", "--save-dir", save])
        shutil.copyfile(masked_lm_data / "dict.txt", save / "dict.txt")

    return built_once(tmp_path_factory, "stock_lm", build) / "checkpoint_last.pt"  # (made once per test run)


def load_lm(path, data):
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(data)})
    models[0].eval()
    return models[0], task


@pytest.fixture(scope="module")
def stock_logits(stock_lm, masked_lm_data):
    model, task = load_lm(stock_lm, masked_lm_data)
    with torch.no_grad():
        return model(random_tokens(task.source_dictionary, batch=3, length=12, seed=5))[0]


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_converted_lm_equals_stock_source(stock_lm, stock_logits, masked_lm_data, tmp_path, encoding):
    state = torch.load(stock_lm, map_location="cpu")
    if encoding in NO_IDENTITY:
        with pytest.raises(convert.ConversionError, match="has no initialisation that adds nothing"):
            convert.convert_checkpoint(state, "transformer_lm", encoding)
        return
    converted = convert.convert_checkpoint(state, "transformer_lm", encoding)
    assert convert.model_namespace(converted).arch == f"transformer_lm_{encoding}"
    torch.save(converted, tmp_path / "converted.pt")
    model, task = load_lm(tmp_path / "converted.pt", masked_lm_data)
    assert type(model) is PositionalLanguageModel
    with torch.no_grad():
        logits = model(random_tokens(task.source_dictionary, batch=3, length=12, seed=5))[0]
    assert (logits - stock_logits).abs().max() <= 1e-5


@pytest.mark.parametrize("evaluated_at", [32, 128])
def test_a_converted_lm_keeps_its_length_under_an_evaluation_task_of_another(stock_lm, masked_lm_data, tmp_path,
                                                                            evaluated_at):
    """fairseq-eval-lm --tokens-per-sample N builds the model from the checkpoint's model config with a task
    of N: stock keeps the length it was trained with (its config's tokens_per_sample, 64). Before, a
    converted model took N: a learned table refused, and with N = 128 it scored 551 tokens where stock
    scores 39 (it skips blocks longer than 64)."""
    from fairseq import checkpoint_utils
    from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

    converted = convert.convert_checkpoint(torch.load(stock_lm, map_location="cpu"), "transformer_lm", "t5")
    torch.save(converted, tmp_path / "converted.pt")
    lengths = []
    for path in (stock_lm, tmp_path / "converted.pt"):
        task = LanguageModelingTask.setup_task(LanguageModelingConfig(data=str(masked_lm_data),
                                                                      tokens_per_sample=evaluated_at))
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], task=task)  # as fairseq-eval-lm
        lengths.append(models[0].max_positions())
    assert lengths == [64, 64]


def test_fine_tuning_a_converted_lm_with_the_printed_options_starts_as_stock(stock_lm, masked_lm_data, tmp_path):
    """fairseq-train builds --restore-file's model from its command line. With the options the converter
    prints, a converted LM takes stock's first fine-tuning step (the same loss and gradient norm); with
    the encoding's defaults it would drop the sinusoidal input embedding, which keeps nothing in a
    checkpoint, and is refused in one line instead."""
    import re
    import shlex
    import subprocess

    from util import BIN, command_env

    destination = tmp_path / "t5.pt"
    out = run([sys.executable, REPO / "scripts" / "convert_transformer_lm_checkpoint.py", stock_lm, destination,
               "--encoding", "t5"])
    printed = shlex.split(out.strip().splitlines()[-1].split("give fairseq-train: ", 1)[1])
    assert printed[:2] == ["--arch", "transformer_lm_t5"] and printed[printed.index("--input-positions") + 1] == "stock"
    assert printed[printed.index("--decoder-embed-dim") + 1] == "32"  # the source's own options too
    train = ["fairseq-train", masked_lm_data, *LM_TASK, *TINY_LM, *QUICK_TRAIN, "--max-update", "1", "--no-save",
             "--save-dir", tmp_path / "unused", "--reset-optimizer", "--reset-dataloader", "--reset-meters", "--user-dir", USER_DIR]

    def first_step(output):
        return re.findall(r"train_inner \| epoch 001: .*?(loss=[^,]+), .*?(gnorm=[^,]+)", output)

    stock = first_step(run([*train, "--arch", "transformer_lm", "--restore-file", stock_lm]))
    assert len(stock) == 1
    assert first_step(run([*train, *printed, "--restore-file", destination])) == stock
    done = subprocess.run([str(BIN / train[0]), *(str(part) for part in train[1:]), "--arch", "transformer_lm_t5",
                           "--restore-file", str(destination)],
                          capture_output=True, text=True, env=command_env())
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("fairseq-train: error: Cannot load model parameters"), \
        done.stderr[-2000:]
    assert "give --input-positions stock to keep it" in done.stderr


def test_conversion_script_and_eval_lm_context_window(stock_lm, masked_lm_data, tmp_path):
    destination = tmp_path / "t5.pt"
    out = run([sys.executable, REPO / "scripts" / "convert_transformer_lm_checkpoint.py", stock_lm, destination,
               "--encoding", "t5"])
    assert "transformer_lm_t5" in out
    evaluate = ["fairseq-eval-lm", masked_lm_data, "--user-dir", USER_DIR, "--gen-subset", "valid", "--cpu",
                "--batch-size", "4", "--num-workers", "0", "--tokens-per-sample", "24"]
    plain = run([*evaluate, "--path", stock_lm])
    converted = run([*evaluate, "--path", destination])
    windowed = run([*evaluate, "--path", destination, "--context-window", "16"])

    def perplexity(output):
        return float(output.rsplit("Perplexity: ", 1)[1].split()[0])

    assert perplexity(plain) == pytest.approx(perplexity(converted), rel=1e-4)
    assert 1 < perplexity(windowed) < 1e4


@pytest.mark.parametrize("encoding", sorted(set(EVERY_ENCODING) - NO_IDENTITY))
def test_hub_sample_and_score_agree(stock_lm, masked_lm_data, tmp_path, encoding):
    """TransformerLanguageModel.from_pretrained(...): greedy generation (step by step) and .score()
    (one full pass) give the same per-token log-probabilities, with the encoding's terms active."""
    from fairseq.models.transformer_lm import TransformerLanguageModel

    state = convert.convert_checkpoint(torch.load(stock_lm, map_location="cpu"), "transformer_lm", encoding,
                                       verify=False)
    generator = torch.Generator().manual_seed(2)
    for key, value in state["model"].items():
        if key.startswith("positional_encoding.") and value.is_floating_point() and not key.endswith(".trained_with"):
            state["model"][key] = value + 0.1 * torch.randn(value.shape, generator=generator)
    torch.save(state, tmp_path / "model.pt")
    shutil.copyfile(masked_lm_data / "dict.txt", tmp_path / "dict.txt")
    hub = TransformerLanguageModel.from_pretrained(str(tmp_path), "model.pt", user_dir=USER_DIR)
    hub.eval()
    words = [hub.task.source_dictionary[i] for i in range(4, 9)]
    prompt = " ".join(words)
    text = hub.sample(prompt, beam=1, max_len_b=6, min_len=6)
    assert text.startswith(prompt) and len(text.split()) > len(words)
    generated = hub.generate([hub.encode(prompt)], beam=1, max_len_b=6, min_len=6)[0][0]
    scored = hub.score(hub.string(generated["tokens"][:-1]))  # without the final </s>
    n = scored["positional_scores"].numel()
    assert n == generated["tokens"].numel() - 1
    assert (scored["positional_scores"] - generated["positional_scores"][:n]).abs().max() <= 1e-4


HYDRA_LM = """
common: {{user_dir: {user_dir}, cpu: true, seed: 1}}
task: {{_name: language_modeling, data: {data}, tokens_per_sample: 24}}
criterion: {{_name: cross_entropy}}
dataset: {{max_tokens: 500, num_workers: 0, disable_validation: true}}
optimization: {{lr: [0.001], max_update: 1}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
checkpoint: {{no_epoch_checkpoints: true}}
model: {{_name: {arch}, decoder_layers: 1, decoder_embed_dim: 16, decoder_ffn_embed_dim: 32,
        decoder_attention_heads: 2, decoder_learned_pos: true}}
"""


def test_hydra_train_takes_the_maximum_positions_from_the_task_as_stock(masked_lm_data, tmp_path):
    """fairseq-hydra-train gives this (argparse) model no task options: its maximum positions fell back
    to 1024 where stock's config reads --tokens-per-sample, so a learned table had 1026 rows instead of
    26 (and a hydra-made model was another model than fairseq-train's). Stock transformer_lm under
    hydra is the reference."""
    saved = {}
    for arch in ("transformer_lm", "transformer_lm_learned"):
        (tmp_path / f"{arch}.yaml").write_text(HYDRA_LM.format(user_dir=USER_DIR, data=masked_lm_data, arch=arch))
        run([str(REPO / ".venv/bin/fairseq-hydra-train"), "--config-dir", tmp_path, "--config-name", arch,
             f"checkpoint.save_dir={tmp_path / arch}", f"hydra.run.dir={tmp_path / arch / 'hydra'}"])
        saved[arch] = torch.load(tmp_path / arch / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    for state in saved.values():
        assert state["model"]["decoder.embed_positions.weight"].shape == (24 + 2, 16)
    assert saved["transformer_lm_learned"]["cfg"]["model"]["max_target_positions"] == 24  # (what later loads build)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", DDP_ENCODINGS)
def test_lm_trains_in_two_gloo_processes(masked_lm_data, tmp_path, encoding):
    """fairseq's legacy DDP over 2 gloo processes (resuming is covered by the translation models'
    DDP test and, for language models, by loading checkpoints in the eval-lm and hub tests)."""
    command = ["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, *LM_TASK, "--arch", f"transformer_lm_{encoding}",
               *TINY_LM, *QUICK_TRAIN, "--save-dir", tmp_path, "--disable-validation", "--max-update", "2"]
    out = run_distributed(command, world_size=2)
    assert "training on 2 devices" in out and "num_updates 2" in out
    assert (tmp_path / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("override,expected", [
    ("+model.t5_num_bucket=16", "--t5-num-bucket: no encoding has this option (did you mean --t5-num-buckets?)"),
    ("+model.t5_num_buckets=7", "--t5-num-buckets"),
    ("+model.input_positions=bogus", "--input-positions bogus: expected one of")])
def test_hydra_train_refuses_a_bad_encoding_option_in_one_line(masked_lm_data, tmp_path, override, expected):
    """hydra prints an exception from the job as a filtered traceback (some 30 lines, the message last)
    unless it is one of its compact exceptions, whose message alone it prints: OptionValueError is one."""
    (tmp_path / "lm.yaml").write_text(HYDRA_LM.format(user_dir=USER_DIR, data=masked_lm_data, arch="transformer_lm_t5"))
    done = subprocess.run([str(REPO / ".venv/bin/fairseq-hydra-train"), "--config-dir", str(tmp_path), "--config-name",
                           "lm", f"checkpoint.save_dir={tmp_path / 'save'}", f"hydra.run.dir={tmp_path / 'hydra'}",
                           override], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1 and "Traceback" not in done.stderr and "File \"" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert any(line.startswith(expected) for line in lines[-4:]), done.stderr[-3000:]  # (hydra's hint follows it)
