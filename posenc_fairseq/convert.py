"""Warm start: turn a stock fairseq `transformer`, `roberta` or `transformer_lm` checkpoint into one of ours.

Pure functions on the checkpoint dict (what `torch.save` wrote: "model" state dict, "cfg" and/or
the older "args" Namespace, optimizer history ...); no file IO. The scripts in `scripts/` are thin
command-line wrappers.

What a conversion does:
- checks that the source is a stock fairseq checkpoint of the expected family (any size variant:
  the model class behind its architecture must be fairseq's own TransformerModel / RobertaModel);
- rewrites the model config: architecture `transformer_{enc}{size}` / `roberta_{enc}{size}` (the
  size suffix of the source where we register it, the base one otherwise: every size value is
  stored explicitly in the source config, so the suffix only names it), `positional_encoding=enc`,
  `input_positions="stock"` (the source's absolute input embedding is kept), every option of
  every encoding at its default, then the caller's overrides;
- copies every source weight unchanged (RoBERTa classification heads included) and adds the
  encoding's parameters, initialised with `reset_to_identity()` so they add nothing;
- drops `last_optimizer_state` (it covers the source parameters only) and an EMA copy of the
  source model; keeps optimizer history and extra state, so `fairseq-train --restore-file DST
  --reset-optimizer` works (and also works without --reset-optimizer);
- runs source and converted model on random input and refuses (ConversionError) when their
  outputs differ by more than 1e-5.
"""
import argparse
import copy
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

KINDS = ("transformer", "roberta", "transformer_lm")
TOLERANCE = 1e-5


class ConversionError(ValueError):
    """The source cannot be converted (wrong kind, not a checkpoint, unknown encoding ...)."""


# --------------------------------------------------------------------------- config access
def _get(obj, key, default=None):
    if obj is None:
        return default
    if isinstance(obj, argparse.Namespace):
        return getattr(obj, key, default)
    if isinstance(obj, DictConfig):
        return obj.get(key, default) if key in obj else default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _set(obj, key, value):
    if isinstance(obj, argparse.Namespace):
        setattr(obj, key, value)
    elif isinstance(obj, DictConfig):
        with open_dict(obj):
            obj[key] = value
    else:
        obj[key] = value


def _model_configs(state: dict) -> list:
    """Every place of the checkpoint that holds the model options (old 'args', new 'cfg.model')."""
    found = []
    if isinstance(state.get("args"), argparse.Namespace):
        found.append(state["args"])
    cfg = state.get("cfg")
    if cfg is not None:
        model = _get(cfg, "model")
        if isinstance(model, (argparse.Namespace, dict, DictConfig)):
            found.append(model)
    return found


def architecture_of(state: dict) -> Optional[str]:
    """The --arch a checkpoint's state was trained with (None where it names none)."""
    if isinstance(state.get("args"), argparse.Namespace):
        return getattr(state["args"], "arch", None)
    cfg = state.get("cfg")
    model = _get(cfg, "model")
    return _get(model, "_name") or _get(model, "arch")


def model_namespace(state: dict) -> argparse.Namespace:
    """The model options as one Namespace (a copy), as fairseq would build the model from."""
    if isinstance(state.get("args"), argparse.Namespace):
        args = copy.deepcopy(state["args"])
        if hasattr(args, "max_positions") and not hasattr(args, "max_source_positions"):
            args.max_source_positions = args.max_target_positions = args.max_positions  # as fairseq's upgrade
        return args
    model = _get(state.get("cfg"), "model")
    if isinstance(model, argparse.Namespace):
        args = copy.deepcopy(model)
    elif isinstance(model, DictConfig):
        args = argparse.Namespace(**OmegaConf.to_container(model, resolve=True))
    else:
        args = argparse.Namespace(**copy.deepcopy(dict(model)))
    if not getattr(args, "arch", None):
        args.arch = getattr(args, "_name", None)
    return args


# --------------------------------------------------------------------------- validation
def _stock_config(kind):
    """The dataclass of the stock model's options, where it has one."""
    if kind == "transformer":
        from fairseq.models.transformer import TransformerConfig
        return TransformerConfig
    return getattr(_stock_class(kind), "__dataclass", None)


def _stock_class(kind):
    if kind == "transformer":
        from fairseq.models.transformer import TransformerModel
        return TransformerModel
    if kind == "transformer_lm":
        from fairseq.models.transformer_lm import TransformerLanguageModel
        return TransformerLanguageModel
    from fairseq.models.roberta import RobertaModel
    return RobertaModel


def _our_class(kind):
    if kind == "transformer":
        from .models.transformer import PositionalTransformerModel
        return PositionalTransformerModel
    if kind == "transformer_lm":
        from .models.lm import PositionalLanguageModel
        return PositionalLanguageModel
    from .models.roberta import PositionalRobertaModel
    return PositionalRobertaModel


def source_kind(state) -> Tuple[Optional[str], str]:
    """(kind or None, description) of a loaded checkpoint object."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return None, "not a fairseq checkpoint (no 'model' state dict)"
    if not _model_configs(state):
        return None, "not a fairseq checkpoint (no 'cfg' or 'args' model configuration)"
    arch = architecture_of(state)
    model_class = ARCH_MODEL_REGISTRY.get(arch)
    if model_class is None:
        return None, f"a checkpoint of the unknown architecture {arch!r}"
    for kind in KINDS:
        if model_class is _our_class(kind):
            return None, f"already a posenc_fairseq checkpoint (architecture {arch})"
    for kind in KINDS:
        if model_class is _stock_class(kind):
            return kind, f"a stock fairseq {kind} checkpoint (architecture {arch})"
    return None, f"a checkpoint of architecture {arch!r} (model {model_class.__name__})"


def check_source(state, kind: str):
    if kind not in KINDS:
        raise ConversionError(f"unknown kind {kind!r}; choose one of {KINDS}")
    found, description = source_kind(state)
    if found != kind:
        hint = f"; use scripts/convert_{found}_checkpoint.py" if found else ""
        raise ConversionError(f"expected a stock fairseq {kind} checkpoint, got {description}{hint}")


def check_encoding(encoding: str):
    from .encodings import ENCODINGS

    if encoding not in ENCODINGS:
        raise ConversionError(f"unknown positional encoding {encoding!r}; choose one of {', '.join(sorted(ENCODINGS))}")
    if not ENCODINGS[encoding].starts_as_identity:
        raise ConversionError(f"encoding {encoding!r} has no initialisation that adds nothing (it is fixed by design), "
                              "so a converted model could not equal the source; train it from scratch instead")


# --------------------------------------------------------------------------- options
def option_parser() -> argparse.ArgumentParser:
    """Our model-level options (encoding choice, input positions, every encoding's options)."""
    from .models.common import add_position_args

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_position_args(parser)
    return parser


def option_defaults() -> Dict[str, object]:
    return vars(option_parser().parse_args([]))


def split_overrides(argv) -> Tuple[Dict[str, object], List[str]]:
    """Command-line encoding options anywhere in `argv` (e.g. ['--floater-method', 'rk4', 'src.pt']) ->
    ({dest: value} of those whose value differs from the default, the other arguments in their order).
    Raises ConversionError on an invalid value."""
    argv = [str(part) for part in argv]
    try:
        known, rest = option_parser().parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as error:
        raise ConversionError(f"invalid encoding option: {error}")
    defaults = option_defaults()
    return {key: value for key, value in vars(known).items() if value != defaults[key]}, rest


def command_line(options: Dict[str, object], parser: Optional[argparse.ArgumentParser] = None) -> List[str]:
    """The command-line options that give `options` ({dest: value}, as `split_overrides` returns them)
    back, in the order of `parser` (default: ours): what fairseq-train must be given to build a
    converted model again."""
    parts = []
    for action in (parser or option_parser())._actions:
        if action.dest not in options or not action.option_strings:
            continue
        value = options[action.dest]
        if action.nargs == 0:  # a flag: present where it differs from its default
            parts += [action.option_strings[0]] if value != action.default else []
        else:
            parts += [action.option_strings[0], *(str(item) for item in (value if isinstance(value, (list, tuple))
                                                                        else [value]))]
    return parts


def source_model_options(converted: dict, kind: str) -> List[str]:
    """The stock model options of `converted` (sizes, normalisation, sharing, dropout, ...) that its
    architecture would not set to the same value without them, as command-line options: fairseq-train
    builds a --restore-file's model from its command line, and a left-out option of the same parameter
    shapes (e.g. --encoder-normalize-before) loads strictly into another model. An option is left out
    where the architecture's function, given the source's other options, sets it to the source's value
    (its default, or a value it follows: --decoder-output-dim from --decoder-embed-dim). A flag the
    architecture sets that the source turned off has no option to say so and is left out."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    args = model_namespace(converted)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _stock_class(kind).add_args(parser)
    # models with a dataclass config add their options without defaults (fairseq fills them from the
    # dataclass after the architecture's function has run)
    config = _stock_config(kind)
    config_defaults = vars(config()) if config is not None else {}
    given = {action.dest: getattr(args, action.dest) for action in parser._actions
             if action.option_strings and getattr(args, action.dest, None) is not None}
    differing = {}
    for action in parser._actions:
        value = given.get(action.dest)
        if value is None or (action.nargs == 0 and not value):
            continue
        without = argparse.Namespace(**{dest: other for dest, other in given.items() if dest != action.dest})
        try:
            ARCH_CONFIG_REGISTRY[args.arch](without)
        except AttributeError:  # (a function that reads the option without a default: it is needed)
            differing[action.dest] = value
            continue
        if value != getattr(without, action.dest, config_defaults.get(action.dest, action.default)):
            differing[action.dest] = value
    return command_line(differing, parser)


def parse_overrides(argv) -> Dict[str, object]:
    """`split_overrides` of encoding options only: ConversionError on anything else."""
    overrides, unknown = split_overrides(argv)
    if unknown:
        raise ConversionError(f"unknown options: {' '.join(unknown)}")
    return overrides


# --------------------------------------------------------------------------- building models
class _Task:
    """What model building needs of a task: dictionaries of the right sizes."""

    def __init__(self, source_dictionary, target_dictionary=None, max_positions=512):
        self.source_dictionary = source_dictionary
        self.target_dictionary = target_dictionary or source_dictionary
        self._max_positions = max_positions

    def max_positions(self):
        return self._max_positions


def _dictionary(size: int):
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for index in range(size - len(dictionary)):
        dictionary.add_symbol(f"w{index}")
    return dictionary


def _embedding_rows(model_state: dict, *suffixes) -> int:
    for key, value in model_state.items():
        if any(key.endswith(suffix) for suffix in suffixes):
            return value.size(0)
    raise ConversionError("no token embedding in the checkpoint's state dict")


def _lm_vocabulary(model_state: dict) -> int:
    """An LM's vocabulary size: its token embedding's rows, or with fairseq's adaptive input
    (`decoder.embed_tokens.embeddings.N.0.weight`, one band of the vocabulary each) their sum."""
    bands = [value.size(0) for key, value in model_state.items()
             if key.startswith("decoder.embed_tokens.embeddings.") and key.endswith(".0.weight")]
    if bands:
        return sum(bands)
    return _embedding_rows(model_state, "decoder.embed_tokens.weight", "decoder.output_projection.weight")


def build_from_state(state: dict, kind: str):
    """Build (untrained) the model a checkpoint describes, with dictionaries of its sizes."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    import posenc_fairseq  # noqa: F401  (registers our models)

    args = model_namespace(state)
    args.load_checkpoint_heads = True  # register RoBERTa classification heads found in the weights
    weights = state["model"]
    if kind == "transformer":
        source = _dictionary(_embedding_rows(weights, "encoder.embed_tokens.weight"))
        target = _dictionary(_embedding_rows(weights, "decoder.embed_tokens.weight"))
        if len(source) == len(target):
            target = source
        task = _Task(source, target)
    else:
        rows = (_lm_vocabulary(weights) if kind == "transformer_lm"
                else _embedding_rows(weights, "sentence_encoder.embed_tokens.weight"))
        tokens_per_sample = getattr(args, "tokens_per_sample", None)
        task = _Task(_dictionary(rows), max_positions=512 if tokens_per_sample is None else tokens_per_sample)
    ARCH_CONFIG_REGISTRY[args.arch](args)
    model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
    return model, args, task


def load_from_state(state: dict, kind: str, strict: bool = True):
    """The model of a checkpoint with its weights, in eval mode, as fairseq would load it."""
    model, args, task = build_from_state(state, kind)
    result = model.load_state_dict(dict(state["model"]), strict=strict, model_cfg=args)
    model.eval()
    return model, task, result


# --------------------------------------------------------------------------- comparing
def random_inputs(kind: str, task, args, seed: int = 0, batch: int = 3, length: int = 12):
    generator = torch.Generator().manual_seed(seed)
    source = task.source_dictionary
    limit = next((value for value in (getattr(args, "max_source_positions", None), getattr(args, "max_positions", None))
                  if value is not None), 512)
    length = max(3, min(length, int(limit) - 2))
    low = source.nspecial
    tokens = torch.randint(low, len(source), (batch, length), generator=generator)
    lengths = torch.tensor([max(2, length - 3 * row) for row in range(batch)])
    if kind == "transformer":  # left-padded source, as fairseq's translation task
        for row, size in enumerate(lengths.tolist()):
            tokens[row, : length - size] = source.pad()
            tokens[row, -1] = source.eos()
        target = task.target_dictionary
        prev = torch.randint(target.nspecial, len(target), (batch, max(2, length - 2)), generator=generator)
        prev[:, 0] = target.eos()
        return tokens, lengths, prev
    if kind == "transformer_lm":  # right-padded, as fairseq's language_modeling task
        for row, size in enumerate(lengths.tolist()):
            tokens[row, size:] = source.pad()
        return tokens, lengths, None
    for row, size in enumerate(lengths.tolist()):  # right-padded, <s> ... </s>
        tokens[row, 0] = source.bos()
        tokens[row, size - 1] = source.eos()
        tokens[row, size:] = source.pad()
    return tokens, lengths, None


def model_outputs(model, kind: str, inputs) -> Dict[str, torch.Tensor]:
    """Every output worth comparing: decoder logits, or RoBERTa features, LM logits and heads."""
    tokens, lengths, prev = inputs
    with torch.no_grad():
        if kind == "transformer":
            return {"logits": model(tokens, lengths, prev)[0]}
        if kind == "transformer_lm":
            return {"logits": model(tokens)[0]}
        outputs = {"features": model(tokens, features_only=True)[0], "lm_logits": model(tokens)[0]}
        for name in getattr(model, "classification_heads", {}):
            outputs[f"head {name}"] = model(tokens, features_only=True, classification_head_name=name)[0]
        return outputs


def max_difference(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> float:
    if first.keys() != second.keys():
        return float("inf")
    worst = 0.0
    for key in first:
        a, b = first[key], second[key]
        if a.shape != b.shape:
            return float("inf")
        a, b = a.float(), b.float()
        gap = torch.where(a == b, torch.zeros_like(a), (a - b).abs())  # equal infinities count as equal
        if gap.isnan().any():
            return float("inf")
        if gap.numel():
            worst = max(worst, gap.max().item())
    return worst


def verify_conversion(source_state: dict, converted_state: dict, kind: str, seed: int = 0) -> float:
    """Max abs difference between the source and converted models' outputs on random input."""
    torch.manual_seed(seed)
    source_model, task, _ = load_from_state(source_state, kind, strict=True)
    converted_model, _, _ = load_from_state(converted_state, kind, strict=True)
    inputs = random_inputs(kind, task, model_namespace(source_state), seed=seed)
    return max_difference(model_outputs(source_model, kind, inputs), model_outputs(converted_model, kind, inputs))


# --------------------------------------------------------------------------- converting
def _size_suffix(kind: str, arch: str) -> str:
    from .models import lm, roberta, transformer

    sizes = {"transformer": transformer.SIZES, "roberta": roberta.SIZES, "transformer_lm": lm.SIZES}[kind]
    # a stock size whose name lacks the family's prefix (RoBERTa's `xlm`) is registered as `_xlm`
    suffix = arch[len(kind):] if arch.startswith(kind) else f"_{arch}"
    return suffix if suffix in sizes else ""


def converted_arch(kind: str, arch: str, encoding: str) -> str:
    return f"{kind}_{encoding}{_size_suffix(kind, arch)}"


def convert_checkpoint(state: dict, kind: str, encoding: str = "floater", overrides: Optional[dict] = None,
                       verify: bool = True, tolerance: float = TOLERANCE) -> dict:
    """A converted copy of `state` (the source dict is not modified; tensors are shared).

    `overrides`: our model options by destination name, e.g. {"floater_method": "rk4"}
    (see `parse_overrides`). Raises ConversionError for a source that is not a stock fairseq
    checkpoint of `kind`, an unknown encoding or option, or outputs differing by > tolerance."""
    options = _model_options(state, kind, encoding, overrides)
    new_arch = converted_arch(kind, architecture_of(state), encoding)
    converted = _with_model_options(state, new_arch, options)
    model = _add_identity_encoding(converted, state, kind, new_arch)

    # optimizer: its state covers the source parameters only; EMA likewise (and its fp32 copy,
    # which fairseq reads only beside "ema")
    converted["last_optimizer_state"] = None
    if isinstance(state.get("extra_state"), dict):
        converted["extra_state"] = {k: v for k, v in state["extra_state"].items()
                                    if k not in ("ema", "ema_fp32_params")}

    if verify:
        difference = verify_conversion(state, converted, kind)
        if not difference <= tolerance:
            raise ConversionError(f"converted {new_arch} differs from the source by {difference:.3g} "
                                  f"(> {tolerance:g}) on random input; refusing to convert")
    # then an initialisation the user asked for on top of the verified identity (FLOATER's
    # --floater-init small: the paper's warm start, close to but not exactly the source)
    if hasattr(model.positional_encoding, "apply_init_option"):
        model.positional_encoding.apply_init_option()
        _copy_encoding_weights(model, converted["model"])
    return converted


def _model_options(state: dict, kind: str, encoding: str, overrides: Optional[dict]) -> dict:
    """Our model options of the converted checkpoint (the defaults, `encoding`, the stock input
    positions, `overrides`), after checking the source, the encoding and the overrides."""
    check_source(state, kind)
    check_encoding(encoding)
    defaults = option_defaults()
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConversionError(f"unknown encoding options: {', '.join(unknown)}")
    if overrides.get("positional_encoding", encoding) != encoding:
        raise ConversionError("give the encoding once (--encoding), not also as positional_encoding")
    if overrides.get("input_positions", "stock") != "stock":
        raise ConversionError(f"--input-positions {overrides['input_positions']}: a converted model keeps the "
                              "source's input embedding (stock), which its weights were trained with; change it "
                              "when fine-tuning, if at all")
    from .encodings import options_of_other_encodings

    foreign = options_of_other_encodings(encoding, overrides)
    if foreign:
        option, owners = next(iter(foreign.items()))
        raise ConversionError(f"{option} is an option of {'/'.join(owners)}, not of {encoding} (--encoding), "
                              "which would not read it")
    return {**defaults, "positional_encoding": encoding, "input_positions": "stock", **overrides}


def _with_model_options(state: dict, new_arch: str, options: dict) -> dict:
    """A shallow copy of `state` whose model configs (`args`, `cfg`: deep copies) name `new_arch`
    and hold `options`. A DictConfig `cfg` (fairseq's loader's) becomes a plain dict, as fairseq-train
    saves it: deepcopy of a DictConfig shares the objects it holds, such as a Namespace `cfg.model`."""
    converted = dict(state)
    for key in ("args", "cfg"):
        if state.get(key) is not None:
            config = OmegaConf.to_container(state[key]) if isinstance(state[key], DictConfig) else state[key]
            converted[key] = copy.deepcopy(config)
    for holder in _model_configs(converted):
        _set(holder, "arch", new_arch)
        if holder is not converted.get("args"):  # the old top-level Namespace has no _name
            _set(holder, "_name", new_arch)
        for key, value in options.items():
            _set(holder, key, value)
    return converted


def _add_identity_encoding(converted: dict, state: dict, kind: str, new_arch: str):
    """Builds our model from `converted`'s options with the source weights, initialises the
    encoding's parameters as identity and sets `converted["model"]` to the source weights plus
    them; returns the model."""
    model, _, result = load_from_state({**converted, "model": state["model"]}, kind, strict=False)
    unexpected = list(result.unexpected_keys)
    missing = [key for key in result.missing_keys if not key.startswith("positional_encoding.")]
    if unexpected or missing:
        raise ConversionError(f"the source weights do not fit {new_arch}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.positional_encoding.reset_to_identity()
    converted["model"] = dict(state["model"])
    _copy_encoding_weights(model, converted["model"])
    return model


def _copy_encoding_weights(model, weights: dict) -> None:
    """Copies of the model's encoding parameters (`positional_encoding.*`) into `weights`."""
    for key, value in model.state_dict().items():
        if key.startswith("positional_encoding."):
            weights[key] = value.detach().clone()
