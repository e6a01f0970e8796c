"""End to end through fairseq's own commands with `--user-dir`: the demo pipeline
(sentencepiece -> preprocess -> train -> generate -> sacrebleu), resuming, interactive
translation, from_pretrained, and clear errors for bad options. Each path loads a checkpoint
under torch >= 2.6's safe loading, which only works because the plugin allow-lists fairseq's
checkpoint globals."""
import re
import subprocess

import pytest

from util import BIN, QUICK_TRAIN, TINY_ROBERTA, TINY_TRANSFORMER, USER_DIR, built_once, run


@pytest.fixture(scope="module")
def trained_alibi(translation_data, tmp_path_factory):
    """A tiny transformer_alibi trained for 4 updates (made once per test run; the tests only read it)."""
    def build(save_dir):
        out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", "transformer_alibi",
                   *TINY_TRANSFORMER, *QUICK_TRAIN, "--max-update", "4", "--save-dir", save_dir])
        assert "num_updates 4" in out

    return built_once(tmp_path_factory, "trained_alibi", build)


def test_generate_loads_the_checkpoint_and_scores(translation_data, trained_alibi):
    out = run(["fairseq-generate", translation_data, "--user-dir", USER_DIR, "--path",
               trained_alibi / "checkpoint_last.pt", "--beam", "3", "--cpu", "--scoring", "sacrebleu",
               "--max-sentences", "8"])
    assert re.search(r"BLEU = [0-9.]+", out)
    # all 20 test sentences: stock fairseq-fixed drops the last batch of 4 (see posenc_fairseq/compat/batch_by_size.py)
    assert "Translated 20 sentences" in out


def test_restore_file_resumes_training(translation_data, trained_alibi, tmp_path):
    out = run(["fairseq-train", translation_data, "--user-dir", USER_DIR, "--arch", "transformer_alibi",
               *TINY_TRANSFORMER, *QUICK_TRAIN, "--max-update", "6", "--save-dir", tmp_path,
               "--restore-file", trained_alibi / "checkpoint_last.pt"])
    assert "Loaded checkpoint" in out and "@ 4 updates" in out and "num_updates 6" in out


def test_interactive_translates_stdin(translation_data, trained_alibi):
    done = subprocess.run([str(BIN / "fairseq-interactive"), str(translation_data), "--user-dir", USER_DIR,
                           "--path", str(trained_alibi / "checkpoint_last.pt"), "--cpu", "--beam", "2",
                           "--source-lang", "src", "--target-lang", "tgt"],
                          input="ka lo mi\nne su\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(re.findall(r"^H-\d", done.stdout, flags=re.M)) == 2


def test_from_pretrained_with_user_dir(translation_data, trained_alibi):
    from fairseq.models.transformer import TransformerModel

    hub = TransformerModel.from_pretrained(str(trained_alibi), checkpoint_file="checkpoint_last.pt",
                                           data_name_or_path=str(translation_data), user_dir=USER_DIR)
    assert type(hub.models[0]).__name__ == "PositionalTransformerModel"
    assert isinstance(hub.translate("ka lo mi", beam=2), str)


def test_roberta_from_pretrained_with_user_dir(masked_lm_data, tmp_path):
    run(["fairseq-train", masked_lm_data, "--user-dir", USER_DIR, "--task", "masked_lm", "--arch", "roberta_alibi",
         "--tokens-per-sample", "64", *TINY_ROBERTA, *QUICK_TRAIN, "--max-update", "2", "--save-dir", tmp_path])
    (tmp_path / "dict.txt").write_text((masked_lm_data / "dict.txt").read_text())
    from fairseq.models.roberta import RobertaModel

    hub = RobertaModel.from_pretrained(str(tmp_path), checkpoint_file="checkpoint_last.pt",
                                       data_name_or_path=str(tmp_path), user_dir=USER_DIR, bpe=None)
    tokens = hub.task.source_dictionary.encode_line("ka lo mi", append_eos=True).long()[None]
    assert hub.extract_features(tokens).shape == (1, tokens.size(1), 32)


@pytest.mark.parametrize("options, message", [
    (["--arch", "transformer_bogus"], "invalid choice: 'transformer_bogus'"),
    (["--arch", "transformer_alibi", "--positional-encoding", "bogus"], "argument --positional-encoding: invalid choice"),
    (["--arch", "transformer_alibi", "--input-positions", "bogus"], "argument --input-positions: invalid choice"),
])
def test_bad_options_give_fairseqs_clear_error(translation_data, options, message):
    done = subprocess.run([str(BIN / "fairseq-train"), str(translation_data), "--user-dir", USER_DIR, "--cpu",
                           *options], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
