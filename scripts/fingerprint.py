#!/usr/bin/env python
"""Bit-for-bit fingerprint of the attention paths of every registered encoding, to check that a
refactor changes no number.

    fingerprint.py dump OUT.pt [--only NAME ...] [--skip-long]
    fingerprint.py compare A.pt B.pt

`dump` builds tiny models through fairseq's own option parsing, tasks and model classes (as
fairseq-train would, as scripts/benchmark.py does) for every encoding in ENCODINGS, with fixed
seeds, in float64 and float32, and runs them; every output tensor and every parameter gradient
goes into one dict `name -> tensor` saved with torch.save. Names are `ARCH/DTYPE/CASE/WHAT`.
Per encoding NAME:

  transformer_NAME (2+2 layers, d 16, 4 heads), a left-padded source and a right-padded target:
    train            forward + backward in train mode, no dropout; one encoder self-attention,
                     one decoder self-attention and one cross-attention are also called with
                     need_weights/need_head_weights and with before_softmax (their outputs join the loss)
    train_attndrop   --dropout 0.1 --attention-dropout 0.2, fixed seed before the forward
    ckpt             --checkpoint-activations, no dropout; ckpt_attndrop: with attention dropout
    eval             eval forward (+ the same need_weights/before_softmax calls)
    flex_eval        eval forward with FlexAttention on (kernels.flex; eager on CPU)
    steps            step-by-step incremental decoding (decoder logits and attention per step)
    beam             fairseq's SequenceGenerator, beam 2, 3 sentences: tokens, scores, attention
    pruned           fairseq's _adaptive_prune_heads (keep 2 of 4 heads in every attention),
                     eval forward, steps and a train forward/backward
    long_*           1024-token inputs: query blocks (kernels/blocks.py) and, float32 training,
                     the BIASED_CPU kernel at its real MIN_LOGITS (B 2 x H 4 x 1024 x 1024 logits)
    small_blocks_*   QUERY_BLOCK / QUERY_BLOCK_ELEMENTS / biased_cpu.MIN_LOGITS (and its backward
                     block) monkeypatched small: blocks of 8 queries and BIASED_CPU on ~40 tokens
  transformer_lm_NAME (2 layers): train, steps (incremental), flex_eval, long_train (float32, causal
                     BIASED_CPU), small_blocks_train
  roberta_NAME (2 layers): train, train_attndrop, pruned_train, small_blocks_train
  variants: shaw with --shaw-values off, lfhc with --lfhc-values on (their other kernel paths).

A tensor of more than BIG elements (the long cases' cross-attention weights) is kept as the sha256
of its bytes (NAME#sha256) and four fixed random projections (NAME#projections).
A case that raises is reported on stderr and leaves its names out (`compare` lists them as missing);
a monkeypatch whose target no longer exists skips its cases the same way.

`compare` prints the number of tensors, how many differ (dtype, shape, or any bit: -0.0 is not
+0.0, NaNs must match in place and payload) and the names of those that differ with their largest
absolute difference, and the names only one file has; exit status 1 if anything differs.

Single-threaded and deterministic: torch.set_num_threads(1), torch.use_deterministic_algorithms.
Run from the root of the tree to fingerprint, with that tree first on the path, e.g.
    cd TREE && PYTHONPATH=TREE .venv/bin/python scripts/fingerprint.py dump /tmp/fp.pt
"""
import argparse
import contextlib
import hashlib
import importlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path[:1]:
    sys.path.insert(0, str(REPO))  # this tree's posenc_fairseq, not an installed one
sys.path.insert(0, str(REPO / "examples"))
from script_helpers import check_output, refuse, replaced_whole  # noqa: E402

USER_DIR = str(REPO / "posenc_fairseq")

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

VOCAB = 40
DIM, FFN, HEADS = 16, 32, 4
TRANSFORMER = ["--encoder-layers", "2", "--decoder-layers", "2",
               "--encoder-embed-dim", str(DIM), "--decoder-embed-dim", str(DIM),
               "--encoder-ffn-embed-dim", str(FFN), "--decoder-ffn-embed-dim", str(FFN),
               "--encoder-attention-heads", str(HEADS), "--decoder-attention-heads", str(HEADS),
               "--max-source-positions", "1100", "--max-target-positions", "1100"]
LM = ["--decoder-layers", "2", "--decoder-embed-dim", str(DIM), "--decoder-input-dim", str(DIM),
      "--decoder-output-dim", str(DIM), "--decoder-ffn-embed-dim", str(FFN),
      "--decoder-attention-heads", str(HEADS), "--tokens-per-sample", "1100", "--sample-break-mode", "none"]
ROBERTA = ["--encoder-layers", "2", "--encoder-embed-dim", str(DIM), "--encoder-ffn-embed-dim", str(FFN),
           "--encoder-attention-heads", str(HEADS), "--max-positions", "128", "--tokens-per-sample", "128"]
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]
ATTN_DROPOUT = ["--dropout", "0.1", "--attention-dropout", "0.2", "--activation-dropout", "0"]
#: encoding -> options of an extra variant (a kernel path the default options do not take)
VARIANTS = {"shaw": ["--shaw-values", "off"], "lfhc": ["--lfhc-values", "on"]}
#: monkeypatches of the small_blocks cases: module -> {attribute: value}
SMALL_BLOCKS = {
    # (the blocks' element budget: QUERY_BLOCK_ELEMENTS, BLOCK_ELEMENTS since the sizers became one constant)
    "posenc_fairseq.kernels.blocks": {"QUERY_BLOCK": 8, "QUERY_BLOCK_ELEMENTS|BLOCK_ELEMENTS": 1},
    "posenc_fairseq.kernels.biased_cpu": {"MIN_LOGITS": 1, "BLOCK_ELEMENTS": 1, "MIN_BLOCK_ROWS": 4},
}
LONG = 1024
#: tensors of more elements are kept as NAME#sha256 (their bytes) and NAME#projections (file size)
BIG = 2 ** 18
DIGEST, PROJECTIONS = "#sha256", "#projections"
#: the flex cases: FlexAttention (eager on CPU, inference) where it serves a call
FLEX_SWITCH = "POSENC_FLEX_ATTENTION"


@contextlib.contextmanager
def flex_on():
    """FlexAttention on: the module attribute where the tree has one (read at import), else the
    environment variable (read when a stack starts a pass)."""
    flex = importlib.import_module("posenc_fairseq.kernels.flex")
    if hasattr(flex, "MODE"):
        with patched({"posenc_fairseq.kernels.flex": {"MODE": "on"}}):
            yield
        return
    previous = os.environ.get(FLEX_SWITCH)
    os.environ[FLEX_SWITCH] = "on"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FLEX_SWITCH, None)
        else:
            os.environ[FLEX_SWITCH] = previous


DTYPES = {"f64": None, "f32": None}  # filled with torch dtypes after import


class PatchMissing(Exception):
    pass


@contextlib.contextmanager
def patched(patches):
    """Set module attributes for the duration; PatchMissing if a module or attribute is gone."""
    saved = []
    try:
        for module_name, values in patches.items():
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                raise PatchMissing(f"{module_name}: {error}")
            for names, value in values.items():
                # "A|B": the first of these names the module has (a constant renamed between trees)
                attribute = next((name for name in names.split("|") if hasattr(module, name)), None)
                if attribute is None:
                    raise PatchMissing(f"{module_name}.{names} does not exist")
                saved.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, value)
        yield
    finally:
        for module, attribute, value in reversed(saved):
            setattr(module, attribute, value)


# --- building ---------------------------------------------------------------------------------------
def write_data(root: Path) -> str:
    words = "".join(f"w{i} 1\n" for i in range(VOCAB))
    for name in ("dict.src.txt", "dict.tgt.txt", "dict.txt"):
        (root / name).write_text(words)
    return str(root)


def build(data, arch, task, extra, dtype, seed=0):
    """The model fairseq-train would build from these options (fixed seed), its encoding's
    parameters moved away from their (possibly zero) init, in `dtype`."""
    import torch
    from fairseq import options, tasks

    argv = [data, "--task", task, "--arch", arch, "--user-dir", USER_DIR, "--cpu", "--seed", "1", *extra]
    if task == "translation":
        argv += ["-s", "src", "-t", "tgt"]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    task_obj = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task_obj.build_model(args)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.positional_encoding.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model.to(dtype), task_obj


def translation_batch(dictionary, batch, src_len, tgt_len, seed=0, left_pad=2, right_pad=2):
    """Left-padded source (row r: r * left_pad pads), right-padded target prefix (the last row
    `right_pad` pads), eos-started; and the target tokens (prev shifted)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    low, high = dictionary.nspecial, len(dictionary)
    src = torch.randint(low, high, (batch, src_len), generator=generator)
    lengths = torch.tensor([max(2, src_len - left_pad * row) for row in range(batch)])
    for row, length in enumerate(lengths.tolist()):
        src[row, : src_len - length] = dictionary.pad()
        src[row, -1] = dictionary.eos()
    target = torch.randint(low, high, (batch, tgt_len), generator=generator)
    if right_pad and batch > 1:
        target[-1, tgt_len - right_pad - 1] = dictionary.eos()
        target[-1, tgt_len - right_pad:] = dictionary.pad()
    target[:-1, -1] = dictionary.eos()
    prev = torch.cat([torch.full((batch, 1), dictionary.eos()), target[:, :-1]], dim=1)
    if right_pad and batch > 1:
        prev[-1, tgt_len - right_pad:] = dictionary.pad()
    return src, lengths, prev, target


def token_batch(dictionary, batch, length, seed=0, right_pad=3, bos=False):
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=generator)
    if bos:
        tokens[:, 0] = dictionary.bos()
    if right_pad and batch > 1:
        tokens[-1, length - right_pad - 1] = dictionary.eos()
        tokens[-1, length - right_pad:] = dictionary.pad()
    return tokens


# --- collecting -----------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.tensors = {}
        self.failed = []

    def put(self, name, value):
        import torch

        if isinstance(value, torch.Tensor):
            if name in self.tensors or name + DIGEST in self.tensors:
                raise KeyError(f"duplicate name {name}")
            value = value.detach()
            if value.numel() > BIG:  # (the long inputs' attention): its bytes' digest and projections
                self.tensors[name + DIGEST] = torch.frombuffer(bytearray(hashlib.sha256(
                    value.contiguous().numpy().tobytes()).digest()), dtype=torch.uint8)
                self.tensors[name + PROJECTIONS] = projections(value)
            else:
                self.tensors[name] = value.clone()
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                self.put(f"{name}.{index}", item)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.put(f"{name}.{key}", item)

    def grads(self, prefix, model):
        for name, parameter in model.named_parameters():
            if parameter.grad is not None:
                self.put(f"{prefix}/grad/{name}", parameter.grad)

    def case(self, name, function, *args):
        import torch

        start = time.perf_counter()
        torch.manual_seed(12345)  # each case starts from the same RNG state, whatever ran before it
        before = set(self.tensors)
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - reported, its names left out
            self.failed.append(name)
            # what it put before it raised goes too: another tree whose case passes would compare its
            # names against a partial set
            for added in set(self.tensors) - before:
                del self.tensors[added]
            if isinstance(error, PatchMissing):
                print(f"SKIPPED {name}: {error}", file=sys.stderr)
            else:
                print(f"FAILED {name}:\n{traceback.format_exc()}", file=sys.stderr)
        return time.perf_counter() - start


def projections(x):
    """Four fixed random linear functionals of `x`, in float64 (non-finite entries read as 0), and
    its shape: what `compare` shows of a tensor stored as a digest."""
    import torch

    generator = torch.Generator().manual_seed(0)
    flat = finite(x.reshape(-1)).double()
    weights = torch.randn(4, flat.numel(), generator=generator, dtype=torch.float64)
    return torch.cat([weights @ flat, torch.tensor(x.shape, dtype=torch.float64)])


def finite(x):
    import torch

    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


def weighted(x, seed):
    """A fixed random linear functional of `x` (its non-finite entries read as 0)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.dtype)
    return (finite(x) * weights).sum()


@contextlib.contextmanager
def probes(recorder, prefix, attentions):
    """Each attention in `attentions` (name -> module), at its first non-incremental call in the
    model's forward, is called again with the same inputs with need_weights + need_head_weights,
    need_weights (head average) and before_softmax; the outputs are recorded and returned in
    `extra` (for the loss)."""
    handles, extra = [], []
    names = ("query", "key", "value")

    for label, module in attentions.items():
        def hook(mod, args, kwargs, label=label):
            if kwargs.get("incremental_state") is not None or label in done:
                return None
            done.add(label)
            call = dict(kwargs)
            call.update(zip(names, args))
            for key in ("need_weights", "need_head_weights", "before_softmax"):
                call.pop(key, None)
            out, weights = mod.forward(**call, need_weights=True, need_head_weights=True)
            out_mean, weights_mean = mod.forward(**call, need_weights=True)
            logits, values = mod.forward(**call, need_weights=False, before_softmax=True)
            results = {"head_weights_out": out, "head_weights": weights, "weights_out": out_mean,
                       "weights": weights_mean, "before_softmax_logits": logits, "before_softmax_values": values}
            for key, value in results.items():
                recorder.put(f"{prefix}/probe/{label}/{key}", value)
                extra.append(value)
            return None
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    done = set()
    try:
        yield extra
    finally:
        for handle in handles:
            handle.remove()


def translation_attentions(model):
    return {"encoder0_self": model.encoder.layers[0].self_attn, "decoder1_self": model.decoder.layers[1].self_attn,
            "decoder0_cross": model.decoder.layers[0].encoder_attn}


def translation_loss(logits, target, pad, extra=()):
    import torch.nn.functional as F

    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=pad, reduction="sum")
    for index, value in enumerate(extra):
        if value.requires_grad:
            loss = loss + weighted(value, 100 + index)
    return loss


# --- the cases --------------------------------------------------------------------------------------
def translation_train(rec, prefix, model, task, batch, seed=None, probe=True):
    import torch

    src, lengths, prev, target = batch
    model.train()
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    with probes(rec, prefix, translation_attentions(model) if probe else {}) as extra:
        logits, out = model(src, lengths, prev)
    rec.put(f"{prefix}/logits", logits)
    rec.put(f"{prefix}/attn", out.get("attn"))
    loss = translation_loss(logits, target, task.target_dictionary.pad(), extra)
    rec.put(f"{prefix}/loss", loss)
    loss.backward()
    rec.grads(prefix, model)
    model.zero_grad(set_to_none=True)


def translation_eval(rec, prefix, model, batch, probe=True):
    import torch

    src, lengths, prev, _ = batch
    model.eval()
    with torch.no_grad(), probes(rec, prefix, translation_attentions(model) if probe else {}):
        encoder_out = model.encoder(src, src_lengths=lengths)
        logits, out = model.decoder(prev, encoder_out=encoder_out)
    rec.put(f"{prefix}/encoder_out", encoder_out["encoder_out"])
    rec.put(f"{prefix}/logits", logits)
    rec.put(f"{prefix}/attn", out.get("attn"))


def translation_steps(rec, prefix, model, batch):
    import torch

    src, lengths, prev, _ = batch
    model.eval()
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        state = {}
        for t in range(prev.size(1)):
            logits, out = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            rec.put(f"{prefix}/step{t}/logits", logits)
            rec.put(f"{prefix}/step{t}/attn", out.get("attn"))


def translation_beam(rec, prefix, model, task, batch):
    import torch
    from fairseq import search
    from fairseq.sequence_generator import SequenceGenerator

    src, lengths, _, _ = batch
    model.eval()
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_a=0, max_len_b=10,
                                  min_len=3, search_strategy=search.BeamSearch(task.target_dictionary))
    try:
        with torch.no_grad():
            hypos = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    finally:  # (the generator set beamable cross-attention on the model: undo it for the next cases)
        model.decoder.set_beam_size(1)
    for sentence, beams in enumerate(hypos):
        for rank, hypo in enumerate(beams):
            for key in ("tokens", "score", "positional_scores", "attention", "alignment"):
                value = hypo.get(key)
                if isinstance(value, torch.Tensor) and value.numel():
                    rec.put(f"{prefix}/s{sentence}/h{rank}/{key}", value)


def prune(attentions, keep=2):
    for attention in attentions:
        reserve = attention._get_reserve_head_index(num_heads_to_keep=keep)
        attention._adaptive_prune_heads(reserve_head_index=reserve)
        attention._set_skip_embed_dim_check()


def transformer_cases(rec, data, arch, extra, dtype_name, long, small):
    import torch

    dtype = DTYPES[dtype_name]
    base = f"{arch}{''.join(extra)}/{dtype_name}"
    model, task = build(data, arch, "translation", [*TRANSFORMER, *NO_DROPOUT, *extra], dtype)
    dictionary = task.source_dictionary
    batch = translation_batch(dictionary, 3, 11, 9, seed=0)
    rec.put(f"{base}/init", dict(model.state_dict()))
    rec.case(f"{base}/train", translation_train, rec, f"{base}/train", model, task, batch)
    rec.case(f"{base}/eval", translation_eval, rec, f"{base}/eval", model, batch)
    rec.case(f"{base}/steps", translation_steps, rec, f"{base}/steps", model, batch)
    rec.case(f"{base}/beam", translation_beam, rec, f"{base}/beam", model, task, batch)
    if small:
        def small_blocks():
            long_batch = translation_batch(dictionary, 2, 40, 37, seed=3, left_pad=5, right_pad=4)
            with patched(SMALL_BLOCKS):
                translation_train(rec, f"{base}/small_blocks_train", model, task, long_batch, probe=False)
                translation_eval(rec, f"{base}/small_blocks_eval", model, long_batch, probe=False)
        rec.case(f"{base}/small_blocks", small_blocks)
    def flex():
        with flex_on():
            translation_eval(rec, f"{base}/flex_eval", model, batch, probe=False)
    rec.case(f"{base}/flex", flex)
    if long:
        def long_cases():
            rows = 2 if dtype is torch.float32 else 1
            long_batch = translation_batch(dictionary, rows, LONG, LONG, seed=4, left_pad=24, right_pad=16)
            translation_train(rec, f"{base}/long_train", model, task, long_batch, probe=False)
            if dtype is torch.float64:
                translation_eval(rec, f"{base}/long_eval", model, long_batch, probe=False)
        rec.case(f"{base}/long", long_cases)
    del model

    model, task = build(data, arch, "translation", [*TRANSFORMER, *ATTN_DROPOUT, *extra], dtype)
    rec.case(f"{base}/train_attndrop", translation_train, rec, f"{base}/train_attndrop", model, task, batch, 1234)
    if small:
        def small_blocks_dropout():
            long_batch = translation_batch(dictionary, 2, 40, 37, seed=3, left_pad=5, right_pad=4)
            with patched(SMALL_BLOCKS):
                translation_train(rec, f"{base}/small_blocks_train_attndrop", model, task, long_batch, 99, probe=False)
        rec.case(f"{base}/small_blocks_attndrop", small_blocks_dropout)
    del model

    model, task = build(data, arch, "translation", [*TRANSFORMER, *NO_DROPOUT, "--checkpoint-activations", *extra], dtype)
    rec.case(f"{base}/ckpt", translation_train, rec, f"{base}/ckpt", model, task, batch, None, False)
    if small:
        def small_blocks_ckpt():
            long_batch = translation_batch(dictionary, 2, 40, 37, seed=3, left_pad=5, right_pad=4)
            with patched(SMALL_BLOCKS):
                translation_train(rec, f"{base}/small_blocks_ckpt", model, task, long_batch, probe=False)
        rec.case(f"{base}/small_blocks_ckpt", small_blocks_ckpt)
    del model
    model, task = build(data, arch, "translation", [*TRANSFORMER, *ATTN_DROPOUT, "--checkpoint-activations", *extra],
                        dtype)
    rec.case(f"{base}/ckpt_attndrop", translation_train, rec, f"{base}/ckpt_attndrop", model, task, batch, 77, False)
    del model

    def pruned():
        model, task = build(data, arch, "translation", [*TRANSFORMER, *NO_DROPOUT, *extra], dtype, seed=2)
        attentions = [layer.self_attn for layer in model.encoder.layers]
        for layer in model.decoder.layers:
            attentions += [layer.self_attn, layer.encoder_attn]
        prune(attentions)
        rec.put(f"{base}/pruned/kept_heads", [a._buffers.get("kept_heads") for a in attentions])
        translation_eval(rec, f"{base}/pruned_eval", model, batch, probe=False)
        translation_steps(rec, f"{base}/pruned_steps", model, batch)
        translation_train(rec, f"{base}/pruned_train", model, task, batch, probe=False)
    rec.case(f"{base}/pruned", pruned)


def lm_cases(rec, data, arch, extra, dtype_name, long, small):
    import torch
    import torch.nn.functional as F

    dtype = DTYPES[dtype_name]
    base = f"{arch}{''.join(extra)}/{dtype_name}"
    model, task = build(data, arch, "language_modeling", [*LM, *NO_DROPOUT, *extra], dtype)
    dictionary = task.source_dictionary
    tokens = token_batch(dictionary, 3, 12, seed=5)
    rec.put(f"{base}/init", dict(model.state_dict()))

    def train(prefix, tokens):
        model.train()
        model.zero_grad(set_to_none=True)
        logits, out = model(tokens[:, :-1])
        rec.put(f"{prefix}/logits", logits)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                               ignore_index=dictionary.pad(), reduction="sum")
        rec.put(f"{prefix}/loss", loss)
        loss.backward()
        rec.grads(prefix, model)
        model.zero_grad(set_to_none=True)

    def steps(prefix):
        model.eval()
        with torch.no_grad():
            full, _ = model(tokens)
            rec.put(f"{prefix}/full_logits", full)
            state = {}
            plain = tokens[:2]  # (no padding)
            for t in range(plain.size(1)):
                logits, _ = model.decoder(plain[:, : t + 1], incremental_state=state)
                rec.put(f"{prefix}/step{t}/logits", logits)

    rec.case(f"{base}/train", train, f"{base}/train", tokens)
    rec.case(f"{base}/steps", steps, f"{base}/steps")

    def flex():
        model.eval()
        with flex_on(), torch.no_grad():
            rec.put(f"{base}/flex_eval/logits", model(tokens)[0])
    rec.case(f"{base}/flex", flex)
    if small:
        def small_blocks():
            with patched(SMALL_BLOCKS):
                train(f"{base}/small_blocks_train", token_batch(dictionary, 2, 41, seed=6, right_pad=5))
        rec.case(f"{base}/small_blocks", small_blocks)
    if long and dtype is torch.float32:
        rec.case(f"{base}/long_train", train, f"{base}/long_train", token_batch(dictionary, 2, LONG + 1, seed=7, right_pad=20))


def roberta_cases(rec, data, arch, extra, dtype_name, small):
    import torch

    dtype = DTYPES[dtype_name]
    base = f"{arch}{''.join(extra)}/{dtype_name}"

    def train(prefix, model, tokens, seed=None):
        model.train()
        model.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        logits, out = model(tokens)
        rec.put(f"{prefix}/logits", logits)
        loss = weighted(logits, 11)
        rec.put(f"{prefix}/loss", loss)
        loss.backward()
        rec.grads(prefix, model)
        model.zero_grad(set_to_none=True)

    model, task = build(data, arch, "masked_lm", [*ROBERTA, *NO_DROPOUT, *extra], dtype)
    dictionary = task.source_dictionary
    tokens = token_batch(dictionary, 3, 12, seed=8, bos=True)
    rec.put(f"{base}/init", dict(model.state_dict()))
    rec.case(f"{base}/train", train, f"{base}/train", model, tokens)
    if small:
        def small_blocks():
            with patched(SMALL_BLOCKS):
                train(f"{base}/small_blocks_train", model, token_batch(dictionary, 2, 40, seed=9, right_pad=6, bos=True))
        rec.case(f"{base}/small_blocks", small_blocks)

    def pruned():
        prune([layer.self_attn for layer in model.encoder.sentence_encoder.layers])
        train(f"{base}/pruned_train", model, tokens)
    rec.case(f"{base}/pruned", pruned)
    del model
    model, task = build(data, arch, "masked_lm", [*ROBERTA, *ATTN_DROPOUT, *extra], dtype)
    rec.case(f"{base}/train_attndrop", train, f"{base}/train_attndrop", model, tokens, 4321)


# --- dump / compare -----------------------------------------------------------------------------------
def dump(out, only=None, skip_long=False):
    out = check_output(out, [], refuse)  # (a folder, or one that cannot be made: said now, not after the run)
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.use_deterministic_algorithms(True)
    DTYPES.update(f64=torch.float64, f32=torch.float32)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    import posenc_fairseq
    from posenc_fairseq.encodings import ENCODINGS

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    print(f"posenc_fairseq: {posenc_fairseq.__file__}", file=sys.stderr)
    names = sorted(ENCODINGS) if not only else list(only)
    rec = Recorder()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp))
        runs = [(name, []) for name in names] + [(name, opts) for name, opts in VARIANTS.items() if name in names]
        for name, extra in runs:
            t0 = time.perf_counter()
            main = not extra
            for dtype_name in ("f64", "f32"):
                transformer_cases(rec, data, f"transformer_{name}", extra, dtype_name, long=main and not skip_long,
                                  small=True)
                lm_cases(rec, data, f"transformer_lm_{name}", extra, dtype_name, long=main and not skip_long,
                         small=True)
                roberta_cases(rec, data, f"roberta_{name}", extra, dtype_name, small=True)
            print(f"{name}{' ' + ' '.join(extra) if extra else ''}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:  # through a temporary file: an interrupt or a full disk leaves an earlier dump whole
        out.parent.mkdir(parents=True, exist_ok=True)
        with replaced_whole(out) as temporary:
            torch.save(rec.tensors, temporary)
    except OSError as error:
        raise SystemExit(f"error: cannot write {out}: {error.strerror or error}") from None
    print(f"{len(rec.tensors)} tensors -> {out} in {time.perf_counter() - started:.1f} s; "
          f"{len(rec.failed)} cases failed or skipped{': ' + ', '.join(rec.failed) if rec.failed else ''}")
    return 0


def same_bits(x, y):
    """Whether two tensors of one dtype and shape hold the same bits: -0.0 and +0.0 differ, and so do
    NaNs in other places or with other payloads (torch.equal takes -0.0 == +0.0 and any NaN as unequal)."""
    import torch

    x, y = x.detach().contiguous().reshape(-1), y.detach().contiguous().reshape(-1)
    if x.is_complex():
        x, y = torch.view_as_real(x).reshape(-1), torch.view_as_real(y).reshape(-1)
    whole = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return torch.equal(x.view(whole), y.view(whole))


def float_difference(x, y):
    """What differs between two floating-point tensors whose bits differ."""
    import torch

    nan_x, nan_y = torch.isnan(x), torch.isnan(y)
    apart = (x != y) & ~nan_x & ~nan_y  # two numbers that differ
    wide = torch.complex128 if x.is_complex() else torch.float64
    details = [f"max abs diff {(x[apart].to(wide) - y[apart].to(wide)).abs().max().item():.3e}"] if apart.any() else []
    if (nan_x != nan_y).any():
        details.append(f"NaN against a number in {int((nan_x != nan_y).sum())} places")
    if not details:  # the same values and NaN places: the bits differ all the same
        return "equal values, other bits (-0.0 against +0.0, or NaN payloads)"
    return ", ".join(details)


def load_dump(path):
    """The name -> tensor dict of a dump; SystemExit with a message if there is none at `path`."""
    import torch

    if not os.path.isfile(path):
        raise SystemExit(f"error: no file {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch.save file, or not a dump of tensors
        raise SystemExit(f"error: {path} is not a fingerprint dump ({type(error).__name__}: {error})") from None


def compare(path_a, path_b):
    a, b = load_dump(path_a), load_dump(path_b)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    common = sorted(set(a) & set(b))
    differ = []
    for name in common:
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            differ.append((name, f"dtype/shape {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"))
        elif not same_bits(x, y):
            if x.is_floating_point() or x.is_complex():
                detail = float_difference(x, y)
            elif name.endswith(DIGEST):
                detail = "bytes differ (stored as a digest; see its #projections)"
            else:
                detail = f"{int((x != y).sum())} of {x.numel()} entries differ"
            differ.append((name, detail))
    print(f"{path_a}: {len(a)} tensors; {path_b}: {len(b)} tensors; {len(common)} in both")
    print(f"{len(differ)} differ" + (f", {len(only_a)} only in {path_a}" if only_a else "")
          + (f", {len(only_b)} only in {path_b}" if only_b else ""))
    for name, detail in differ:
        print(f"  DIFF {name}: {detail}")
    for name in only_a:
        print(f"  ONLY IN A {name}")
    for name in only_b:
        print(f"  ONLY IN B {name}")
    return 1 if differ or only_a or only_b else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="run every case, save name -> tensor")
    d.add_argument("out")
    d.add_argument("--only", nargs="+", metavar="NAME", help="these encodings only (default: all registered)")
    d.add_argument("--skip-long", action="store_true", help="leave out the 1024-token cases")
    c = sub.add_parser("compare", help="compare two dumps bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args(argv)
    if args.command == "dump":
        return dump(args.out, args.only, args.skip_long)
    return compare(args.a, args.b)


if __name__ == "__main__":
    # (imported here, after OMP_NUM_THREADS above: it imports torch; called here, not in main: the tests
    # call main in their own process)
    from posenc_fairseq.cli_signals import end_on_terminate

    end_on_terminate()
    sys.exit(main())
