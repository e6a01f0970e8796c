"""Warm start: stock fairseq checkpoints -> ours (scripts/convert_*_checkpoint.py).

Source checkpoints are trained here for 2 updates with STOCK fairseq. Equality of converted and
source models is checked independently of the converter's own check: both checkpoints are loaded
the way users load them (checkpoint_utils.load_model_ensemble, RobertaModel.from_pretrained)."""
import hashlib
import shutil
import subprocess
import sys

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq import convert
from posenc_fairseq.encodings import ENCODINGS
from util import QUICK_TRAIN, REPO, TINY_TRANSFORMER, USER_DIR, random_batch, run

EVERY_ENCODING = sorted(ENCODINGS)
# Parameter-free encodings whose position terms cannot be switched off: no initialisation adds
# nothing, so the converter must refuse them (its own output check catches it).
NO_IDENTITY = {"alibi", "rotary"}
SCRIPTS = REPO / "scripts"


def script(kind, *arguments, check=True):
    done = subprocess.run([sys.executable, str(SCRIPTS / f"convert_{kind}_checkpoint.py"), *map(str, arguments)],
                          capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"conversion failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}")
    return done


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def stock_transformer(stock_transformer_checkpoint):
    return stock_transformer_checkpoint  # (conftest: shared by the test run; no test writes to it)


@pytest.fixture(scope="module")
def stock_roberta(masked_lm_data, stock_roberta_checkpoint, tmp_path_factory):
    """A stock RoBERTa folder as fairseq ships it (model.pt + dict.txt) with a classification head."""
    folder = tmp_path_factory.mktemp("roberta_release")
    state = torch.load(stock_roberta_checkpoint, map_location="cpu")
    # add a (random) classification head, as fine-tuned releases carry
    generator = torch.Generator().manual_seed(3)
    embed = 32
    for name, shape in {"dense.weight": (embed, embed), "dense.bias": (embed,),
                        "out_proj.weight": (3, embed), "out_proj.bias": (3,)}.items():
        state["model"][f"classification_heads.topic.{name}"] = torch.randn(shape, generator=generator)
    torch.save(state, folder / "model.pt")
    shutil.copyfile(masked_lm_data / "dict.txt", folder / "dict.txt")
    return folder / "model.pt"


def load_translation(path, data):
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": str(data)})
    model = models[0]
    model.eval()
    return model, task


def translation_logits(path, data):
    model, task = load_translation(path, data)
    src, src_lengths, prev = random_batch(task.source_dictionary, batch=3, src_len=11, tgt_len=9, seed=5)
    with torch.no_grad():
        return model(src, src_lengths, prev)[0]


def roberta_outputs(path):
    from fairseq.models.roberta import RobertaModel

    hub = RobertaModel.from_pretrained(str(path.parent), checkpoint_file=path.name, user_dir=USER_DIR,
                                     bpe="characters")  # gpt2 would download its vocabulary
    hub.eval()
    dictionary = hub.task.source_dictionary
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (2, 14), generator=generator)
    tokens[:, 0], tokens[:, -1] = dictionary.bos(), dictionary.eos()
    tokens[1, 9:] = dictionary.pad()
    tokens[1, 8] = dictionary.eos()
    with torch.no_grad():
        features = hub.model(tokens, features_only=True)[0]
        head = hub.model(tokens, features_only=True, classification_head_name="topic")[0]
    return torch.cat([features.flatten(), head.flatten()])


@pytest.fixture(scope="module")
def source_logits(stock_transformer, translation_data):
    return translation_logits(stock_transformer, translation_data)


@pytest.fixture(scope="module")
def source_roberta_outputs(stock_roberta):
    return roberta_outputs(stock_roberta)


def convert_in_process(src, dst, kind, encoding):
    state = torch.load(src, map_location="cpu")
    if encoding in NO_IDENTITY:
        with pytest.raises(convert.ConversionError, match="has no initialisation that adds nothing"):
            convert.convert_checkpoint(state, kind, encoding)
        return False
    torch.save(convert.convert_checkpoint(state, kind, encoding), dst)
    return True


@pytest.mark.parametrize("kind", ["transformer", "transformer_lm", "roberta"])
def test_a_converted_checkpoint_keeps_its_sizes_name(kind):
    """Each of fairseq's architectures of the kind (its registry) converts to the same size of ours,
    e.g. transformer_wmt_en_de_big -> transformer_t5_wmt_en_de_big; RoBERTa's `xlm`, whose name lacks
    the prefix, to roberta_t5_xlm (the dimensions are kept from the source's config either way)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    stock = [arch for arch, model in ARCH_MODEL_REGISTRY.items() if model is ARCH_MODEL_REGISTRY[kind]]
    assert len(stock) >= 3
    for arch in stock:
        expected = f"{kind}_t5" + ("_xlm" if arch == "xlm" else arch[len(kind):])
        assert convert.converted_arch(kind, arch, "t5") == expected
        assert expected in ARCH_MODEL_REGISTRY


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_converted_transformer_equals_source(stock_transformer, translation_data, source_logits, tmp_path, encoding):
    dst = tmp_path / "converted.pt"
    if convert_in_process(stock_transformer, dst, "transformer", encoding):
        model, _ = load_translation(dst, translation_data)
        assert type(model).__name__ == "PositionalTransformerModel"
        assert (translation_logits(dst, translation_data) - source_logits).abs().max() <= 1e-5


@pytest.mark.parametrize("encoding", EVERY_ENCODING)
def test_converted_roberta_equals_source(stock_roberta, source_roberta_outputs, tmp_path, encoding):
    dst = tmp_path / "model.pt"
    shutil.copyfile(stock_roberta.parent / "dict.txt", tmp_path / "dict.txt")
    if convert_in_process(stock_roberta, dst, "roberta", encoding):
        assert (roberta_outputs(dst) - source_roberta_outputs).abs().max() <= 1e-5


def test_a_roberta_checkpoint_in_fairseqs_older_key_names_converts(stock_roberta, source_roberta_outputs, tmp_path):
    """Older RoBERTa checkpoints (the layout of the released roberta.base/large model.pt) name the encoder
    decoder.sentence_encoder.* and its embedding norm emb_layer_norm; fairseq renames them as it loads
    (upgrade_state_dict_named). Before, the converter checked the learned input table before that
    renaming, found it under an unknown name and refused the checkpoint."""
    def older(key):
        key = "decoder." + key[len("encoder."):] if key.startswith("encoder.") else key
        return key.replace(".layernorm_embedding.", ".emb_layer_norm.")

    state = torch.load(stock_roberta, map_location="cpu")
    state["model"] = {older(key): value for key, value in state["model"].items()}
    assert any(key.startswith("decoder.sentence_encoder.embed_positions") for key in state["model"])
    torch.save(state, tmp_path / "older.pt")
    shutil.copyfile(stock_roberta.parent / "dict.txt", tmp_path / "dict.txt")
    assert (roberta_outputs(tmp_path / "older.pt") - source_roberta_outputs).abs().max() == 0  # stock loads it
    assert convert_in_process(tmp_path / "older.pt", tmp_path / "model.pt", "roberta", "t5")
    assert (roberta_outputs(tmp_path / "model.pt") - source_roberta_outputs).abs().max() <= 1e-5


def test_transformer_script_generate_and_resume(stock_transformer, translation_data, tmp_path):
    before = digest(stock_transformer)
    dst = tmp_path / "floater.pt"
    done = script("transformer", stock_transformer, dst, "--floater-method", "euler")
    assert "transformer_floater" in done.stdout
    assert digest(stock_transformer) == before
    state = torch.load(dst, map_location="cpu")
    assert state["last_optimizer_state"] is None
    assert convert.model_namespace(state).floater_method == "euler"
    assert any(key.startswith("positional_encoding.") for key in state["model"])
    source = torch.load(stock_transformer, map_location="cpu")["model"]
    assert all(torch.equal(state["model"][key], value) for key, value in source.items())

    out = run(["fairseq-generate", translation_data, "--user-dir", USER_DIR, "--path", dst, "--gen-subset", "test",
               "--beam", "2", "--batch-size", "8", "--cpu", "--max-len-b", "20"])
    assert "BLEU" in out
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--task", "translation",
               "--arch", "transformer_floater", "--floater-method", "euler", "--input-positions", "stock",
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--restore-file", dst, "--reset-optimizer", "--max-update", "4",
               "--save-dir", tmp_path / "resume"])
    assert "num_updates 4" in out or "num_updates=4" in out or (tmp_path / "resume" / "checkpoint_last.pt").exists()


def test_roberta_script_copies_dictionary_and_loads(stock_roberta, source_roberta_outputs, tmp_path):
    dst = tmp_path / "out" / "model.pt"
    dst.parent.mkdir()
    script("roberta", stock_roberta, dst, "--encoding", "t5")
    assert (dst.parent / "dict.txt").read_bytes() == (stock_roberta.parent / "dict.txt").read_bytes()
    assert (roberta_outputs(dst) - source_roberta_outputs).abs().max() <= 1e-5
    state = torch.load(dst, map_location="cpu")
    assert convert.model_namespace(state).arch == "roberta_t5_base"
    assert "classification_heads.topic.out_proj.weight" in state["model"]


@pytest.mark.parametrize("case", ["text file", "other kind", "unknown encoding", "dst is src", "ours already"])
def test_clear_errors_and_no_output(stock_transformer, stock_roberta, tmp_path, case):
    dst = tmp_path / "dst.pt"
    if case == "text file":
        src = tmp_path / "notes.pt"
        src.write_text("not a checkpoint\n")
        arguments, expected = [src, dst], "is not a fairseq checkpoint"
    elif case == "other kind":
        arguments, expected = [stock_roberta, dst], "expected a stock fairseq transformer checkpoint, got a stock fairseq roberta"
    elif case == "unknown encoding":
        arguments, expected = [stock_transformer, dst, "--encoding", "bogus"], "unknown positional encoding 'bogus'"
    elif case == "dst is src":
        copy = tmp_path / "copy.pt"
        shutil.copyfile(stock_transformer, copy)
        before = digest(copy)
        done = script("transformer", copy, tmp_path / "." / "copy.pt", check=False)
        assert done.returncode == 2 and "refusing to overwrite" in done.stderr
        assert digest(copy) == before
        return
    else:
        ours = tmp_path / "ours.pt"
        torch.save(convert.convert_checkpoint(torch.load(stock_transformer, map_location="cpu"), "transformer", "t5"), ours)
        arguments, expected = [ours, dst], "already a posenc_fairseq checkpoint"
    done = script("transformer", *arguments, check=False)
    assert done.returncode == 2
    assert expected in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("error:")]) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert not dst.exists()
    assert not list(tmp_path.glob(".convert-*"))


def test_pure_function_errors_and_source_untouched(stock_transformer):
    state = torch.load(stock_transformer, map_location="cpu")
    arch, keys = state["cfg"]["model"].arch, set(state["model"])
    with pytest.raises(convert.ConversionError, match="unknown positional encoding"):
        convert.convert_checkpoint(state, "transformer", "nosuch")
    with pytest.raises(convert.ConversionError, match="unknown encoding options"):
        convert.convert_checkpoint(state, "transformer", "t5", {"no_such_option": 1})
    with pytest.raises(convert.ConversionError, match="expected a stock fairseq roberta"):
        convert.convert_checkpoint(state, "roberta", "t5")
    with pytest.raises(convert.ConversionError, match="not a fairseq checkpoint"):
        convert.convert_checkpoint({"hello": 1}, "transformer", "t5")
    converted = convert.convert_checkpoint(state, "transformer", "t5", convert.parse_overrides(["--t5-num-buckets", "8"]))
    assert converted["cfg"]["model"].arch == "transformer_t5" and converted["cfg"]["model"].t5_num_buckets == 8
    assert state["cfg"]["model"].arch == arch and set(state["model"]) == keys  # the source dict is not modified


def test_floater_init_small_moves_the_dynamics_after_the_identity(stock_transformer, translation_data, source_logits,
                                                                   tmp_path):
    """--floater-init small (the paper's warm start) writes small random dynamics into the converted
    weights, after the check of the identity: h's last layer differs from the default conversion's
    (zero); the default conversion's outputs are the source's (to float32 rounding: other kernels),
    the small one's differ from the default's, which runs the same kernels."""
    state = torch.load(stock_transformer, map_location="cpu")
    default = convert.convert_checkpoint(state, "transformer", "floater")
    small = convert.convert_checkpoint(state, "transformer", "floater",
                                       convert.parse_overrides(["--floater-init", "small"]))
    last_layer = [key for key in default["model"] if key.startswith("positional_encoding.") and ".fc2.weight" in key]
    assert last_layer
    for key in last_layer:
        assert default["model"][key].abs().max() == 0
        assert small["model"][key].abs().max() > 0
    for name, converted in (("default.pt", default), ("small.pt", small)):
        torch.save(converted, tmp_path / name)
    default_logits = translation_logits(tmp_path / "default.pt", translation_data)
    assert (default_logits - source_logits).abs().max() <= 1e-5
    assert (translation_logits(tmp_path / "small.pt", translation_data) - default_logits).abs().max() > 0


def test_max_difference_is_the_largest_gap():
    """The conversion's check compares the largest gap with the tolerance, not a mean over outputs."""
    assert convert.max_difference({"a": torch.tensor([0.0, 0.0, 0.0, 1.0])}, {"a": torch.zeros(4)}) == 1.0
    assert convert.max_difference({"a": torch.zeros(4), "b": torch.tensor([0.0, -2.0])},
                                  {"a": torch.zeros(4), "b": torch.zeros(2)}) == 2.0


def test_verification_compares_the_classification_heads(stock_roberta):
    """A converted RoBERTa whose classification head differs from the source's is noticed by the
    conversion's check, though its features and LM outputs are the source's."""
    state = torch.load(stock_roberta, map_location="cpu")
    converted = convert.convert_checkpoint(state, "roberta", "t5", verify=False)
    assert convert.verify_conversion(state, converted, "roberta") <= convert.TOLERANCE
    converted["model"] = dict(converted["model"])
    converted["model"]["classification_heads.topic.out_proj.bias"] = state["model"][
        "classification_heads.topic.out_proj.bias"] + 1.0
    assert convert.verify_conversion(state, converted, "roberta") >= 0.5


def test_a_source_missing_a_weight_is_refused_without_verification(stock_transformer):
    """A source whose weights do not fit the converted architecture is refused with ConversionError
    even with the output check off (verify=False), which would otherwise be what notices it."""
    state = torch.load(stock_transformer, map_location="cpu")
    state["model"] = {key: value for key, value in state["model"].items() if key != "decoder.layers.0.fc1.weight"}
    with pytest.raises(convert.ConversionError, match="do not fit .*decoder.layers.0.fc1.weight"):
        convert.convert_checkpoint(state, "transformer", "t5", verify=False)
