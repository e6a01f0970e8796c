"""Loading weights into this package's models: LayerDrop pruning of the encoding's per-layer
parameters (--encoder/decoder-layers-to-keep), and the checks that refuse weights the model would
compute otherwise with (another input position table, options or encoding), each with its reason."""
import re
from typing import Optional

import torch

from ..encodings import ENCODINGS
from ..encodings import trained_with
from ..encodings.base import PositionalEncoding
from ..encodings.option_types import OptionValueError, flag_name


# --- LayerDrop pruning (--encoder-layers-to-keep / --decoder-layers-to-keep) ------------------------
_PER_LAYER = re.compile(r"^(encoder|decoder)(_?)(\d+)((?:_.*)?)$")


def _layers_to_keep(cfg, role):
    value = getattr(cfg, f"{role}_layers_to_keep", None) if cfg is not None else None
    return sorted(int(layer) for layer in str(value).split(",")) if value else None


def prune_encoding_state_dict(state_dict, model_cfg, prefix="positional_encoding."):
    """What fairseq's `checkpoint_utils.prune_state_dict` does to `*.layers.N.*`, done to the
    encoding's per-layer parameters: a key component `{role}{N}` / `{role}_{N}[_...]` (Shaw/LFHC
    tables, XL/GCDF projections, T5/AT5 per-layer sets) of a kept layer is renumbered to the layer's
    new index, one of a dropped layer is removed; every other encoding key is kept. FLOATER's table
    `cache` is laid out by layer and is dropped, so the loaded model solves it for its own layers.
    Same condition as fairseq's (a config with an arch and *_layers_to_keep), so that the encoding
    is renumbered exactly when the layers are. A pruning that would change what the encoding defines
    by a layer's depth (`depth_changed_by_pruning`: LFHC's l, a first-layer-only bias or FLOATER block)
    is refused. Returns a new dict."""
    if model_cfg is None:
        return state_dict
    arch = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    keep = {role: _layers_to_keep(model_cfg, role) for role in ("encoder", "decoder")}
    if arch is None or arch == "ptt_transformer" or not any(keep.values()):
        return state_dict
    encoding = ENCODINGS.get(getattr(model_cfg, "positional_encoding", None))
    for role, layers in keep.items():
        changed = encoding.depth_changed_by_pruning(model_cfg, role, layers) if encoding and layers else None
        if changed:
            raise OptionValueError(f"--{role}-layers-to-keep {','.join(map(str, layers))}: {changed}, a model it "
                                   "was not trained as; keep other layers")
    mapping = {role: {old: new for new, old in enumerate(layers)} for role, layers in keep.items() if layers}
    pruned = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            pruned[key] = value
            continue
        parts = key[len(prefix):].split(".")
        if parts[-1] == "cache":
            continue
        dropped = False
        for index, part in enumerate(parts):
            match = _PER_LAYER.match(part)
            if match and match.group(1) in mapping:
                role, sep, layer, rest = match.groups()
                if int(layer) not in mapping[role]:
                    dropped = True
                    break
                parts[index] = f"{role}{sep}{mapping[role][int(layer)]}{rest}"
        if not dropped:
            pruned[prefix + ".".join(parts)] = value
    return pruned


LEARNED_TABLE = "embed_positions.weight"
#: the option that sizes each stack's learned input table (its rows: that many positions + padding_idx + 1)
TABLE_SIZE_OPTION = {"encoder.sentence_encoder.": "max_positions", "encoder.": "max_source_positions",
                     "decoder.": "max_target_positions"}
#: the state-dict key that says the weights were trained or converted with the stock input embedding
STOCK_INPUT_KEPT = "positional_encoding.input_positions_stock"


def take_allow_encoding_change(model, args) -> None:
    """--allow-encoding-change, for the loads of this run (the model's `load_state_dict`): taken out of
    `args`, the config fairseq saves with the model, so that later loads of its checkpoints check."""
    model.allow_encoding_change = bool(getattr(args, "allow_encoding_change", None))
    if getattr(args, "allow_encoding_change", None) is not None:
        args.allow_encoding_change = None


def keeps_stock_input(args) -> bool:
    """Whether a model built from `args` keeps the base architecture's input embedding where its
    encoding would not (a converted checkpoint's relative encodings): its state dict says so."""
    return (args.input_positions == "stock"
            and ENCODINGS[args.positional_encoding].default_input_positions != "stock")


def check_stock_input_kept(state_dict, cfg) -> None:
    """Refuse weights that keep the stock input embedding (`STOCK_INPUT_KEPT`) for a model that
    dropped it by default: fairseq-train builds --restore-file's model from its command line, and a
    sinusoidal embedding keeps nothing in a checkpoint, so nothing else would tell. A choice given
    (--input-positions none, say) is taken as meant."""
    if STOCK_INPUT_KEPT not in state_dict or cfg is None or getattr(cfg, "input_positions", None) == "stock":
        return
    if getattr(cfg, "input_positions_default", None) == cfg.input_positions:
        raise OptionValueError(
            f"--input-positions {cfg.input_positions} (the encoding's default): the checkpoint's weights were "
            f"trained or converted with the stock input embedding; give --input-positions stock to keep it, "
            f"or --input-positions {cfg.input_positions} to drop it")


def check_learned_input_tables(model_state, state_dict, cfg) -> None:
    """Refuse, in one line naming the option, a checkpoint whose learned input position tables
    (fairseq's `STACK.embed_positions.weight`) are not where the model has them, or not of its size:
    a model built with another --input-positions than the checkpoint's (a converted checkpoint
    fine-tuned with --restore-file under the encoding's default, say), or with other maximum
    positions (fine-tuning on longer inputs), which fairseq's strict load reports only as an
    unexpected or missing key or torch's size mismatch. (A sinusoidal embedding keeps nothing in a
    checkpoint, so sinusoidal and none are not told apart here, as in stock fairseq.)"""
    ours = {key for key in model_state if key.endswith(LEARNED_TABLE)}
    theirs = {key for key in state_dict if key.endswith(LEARNED_TABLE)}
    choice = getattr(cfg, "input_positions", None)
    if theirs - ours:
        raise OptionValueError(
            f"--input-positions {choice}: the checkpoint has a learned input position table "
            f"({sorted(theirs - ours)[0]}) that this model has no place for; build the model with the "
            f"checkpoint's --input-positions (stock for a converted checkpoint, docs/conversion.md)")
    if ours - theirs:
        raise OptionValueError(
            f"--input-positions {choice}: the model has a learned input position table "
            f"({sorted(ours - theirs)[0]}) that the checkpoint lacks; build the model with the checkpoint's "
            f"--input-positions")
    for key in sorted(ours):
        extra_rows = state_dict[key].size(0) - model_state[key].size(0)
        if extra_rows != 0:
            raise learned_table_size_error(key, extra_rows, cfg)


def learned_table_size_error(key: str, extra_rows: int, cfg) -> OptionValueError:
    """The refusal of a checkpoint's learned table `key` that has `extra_rows` more rows (positions)
    than the model's: names the option that sizes it, with the value that would load it."""
    dest = TABLE_SIZE_OPTION.get(key[:-len(LEARNED_TABLE)])
    built = getattr(cfg, dest, None) if dest is not None else None
    if not isinstance(built, int):
        return OptionValueError(
            f"the checkpoint's learned input position table ({key}) holds {abs(extra_rows)} "
            f"{'more' if extra_rows > 0 else 'fewer'} positions than the model's; a learned table has a fixed size: "
            f"build the model with the checkpoint's maximum positions")
    option = flag_name(dest)
    default = " (by default --tokens-per-sample)" if dest == "max_target_positions" and \
        hasattr(cfg, "tokens_per_sample") and not hasattr(cfg, "max_source_positions") else ""
    return OptionValueError(
        f"{option} {built}{default}: the checkpoint's learned input position table ({key}) holds "
        f"{built + extra_rows} positions, this model's {built}; a learned table has a fixed size: give "
        f"{option} {built + extra_rows}, for inputs of at most {built + extra_rows} tokens")


def check_encoding_entries(model, state_dict, loadable: bool = True) -> None:
    """Refuse weights whose encoding entry (encodings/trained_with.py) says they were trained with
    another encoding, or with another value of an option the model's encoding has by default: every
    encoding module of `model` (a `PerStackEncoding`'s two parts) checks its own. `loadable`: whether
    the encoding's weights fit the model's (else --allow-encoding-change is no way out)."""
    for name, module in model.named_modules():
        saved = state_dict.get(f"{name}.{trained_with.KEY}") if isinstance(module, PositionalEncoding) else None
        if saved is not None:
            module.check_trained_with(saved, loadable)


def encoding_prefixes(model) -> tuple:
    """The state-dict prefixes of `model`'s encoding modules."""
    return tuple(f"{name}." for name, module in model.named_modules() if name and isinstance(module, PositionalEncoding))


def encoding_weights_fit(model, model_state, state_dict) -> bool:
    """Whether the checkpoint's encoding weights can be loaded into the model's as they are, as far as
    known before the load: no weight both hold in other shapes, and not weights on one side only. (Key
    names alone do not tell: an encoding renames older keys and takes extra state as it loads.)"""
    prefixes = encoding_prefixes(model)

    def weights(state):
        return {key: value for key, value in state.items() if key.startswith(prefixes) and key != STOCK_INPUT_KEPT
                and not key.endswith(f".{trained_with.KEY}")}
    ours, theirs = weights(model_state), weights(state_dict)
    if bool(ours) != bool(theirs):
        return False
    return all(ours[key].shape == theirs[key].shape for key in set(ours) & set(theirs) if torch.is_tensor(ours[key]))


def encoding_load_error(model, error: RuntimeError, state_dict, stock_converter: str) -> Optional[str]:
    """torch's strict-load `error` in one line where every key it names is an encoding's (None where it
    names another: that error stays torch's): a stock checkpoint not converted (`stock_converter`), or an
    encoding option that sizes the tables (--t5-num-buckets, --shaw-k, ...) other than the weights had."""
    prefixes, lines = encoding_prefixes(model), str(error).split("\n")
    missing = [key for line in lines if "Missing key(s) in state_dict:" in line for key in re.findall(r'"([^"]+)"', line)]
    unexpected = [key for line in lines if "Unexpected key(s) in state_dict:" in line
                  for key in re.findall(r'"([^"]+)"', line)]
    resized = re.findall(r"size mismatch for ([^:]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                         r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)", str(error))
    named = missing + unexpected + [key for key, _, _ in resized]
    if not named or not prefixes or not all(key.startswith(prefixes) for key in named):
        return None
    entries = [key for key in state_dict if key.endswith(f".{trained_with.KEY}")]
    if not entries and not any(key.startswith(prefixes) for key in state_dict):
        return (f"the checkpoint has none of this model's positional-encoding weights ({missing[0]}, ...): a "
                f"stock fairseq checkpoint is converted first ({stock_converter}, docs/conversion.md)")
    differences = ([f"{key} missing" for key in missing] + [f"{key} unexpected" for key in unexpected]
                   + [f"{key} of shape {theirs} in the checkpoint, {ours} here" for key, theirs, ours in resized])
    trained = [trained_with.described(state_dict[key]) for key in entries]
    return (f"the checkpoint's positional-encoding weights do not fit this model's ({'; '.join(differences[:3])}"
            f"{'; ...' if len(differences) > 3 else ''}): build the model with the encoding options the weights "
            f"were trained with{' (' + '; '.join(trained) + ')' if trained else ''}")


class EncodingStateMixin:
    """Model mixin for state dicts: per-layer encoding parameters follow their layer under LayerDrop
    pruning; learned input tables that the model and checkpoint disagree on are refused, and so are
    weights that keep the stock input embedding for a model that dropped it by default, and weights
    trained with another encoding or option value than the model's default (`check_encoding_entries`,
    unless --allow-encoding-change), and encoding weights of other names or shapes, named where the load fails (`encoding_load_error`)."""

    #: the script that converts the stock checkpoints of this kind of model (named in refusals)
    stock_converter = "scripts/convert_transformer_checkpoint.py"

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        cfg = model_cfg if model_cfg is not None else args
        # fairseq's renaming of older keys first (RoBERTa's decoder.sentence_encoder.*, as the released
        # model.pt name them), which its own load_state_dict does again below (a no-op then): the checks
        # read the keys as this model names them
        self.upgrade_state_dict(state_dict)
        state_dict = prune_encoding_state_dict(state_dict, cfg)
        if strict:
            model_state = self.state_dict()
            check_stock_input_kept(state_dict, cfg)
            check_learned_input_tables(model_state, state_dict, cfg)
            if not getattr(self, "allow_encoding_change", False):
                check_encoding_entries(self, state_dict, encoding_weights_fit(self, model_state, state_dict))
        state_dict = {key: value for key, value in state_dict.items() if key != STOCK_INPUT_KEPT}
        try:
            return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        except RuntimeError as error:  # (torch's missing/unexpected keys or size mismatch)
            told = encoding_load_error(self, error, state_dict, self.stock_converter) if strict else None
            if told is None:
                raise
            raise OptionValueError(told) from error

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(self, "stock_input_kept", False):
            destination[prefix + STOCK_INPUT_KEPT] = torch.ones(1)
