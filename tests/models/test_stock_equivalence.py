"""With no encoding term, our models ARE fairseq's: same initialisation (the attention class is
swapped after fairseq builds it), same outputs, same beam search (which exercises fairseq's
beamable cross-attention and cache reordering inside our attention)."""
import re
from types import SimpleNamespace

import pytest
import torch

from fairseq import checkpoint_utils, search
from fairseq.sequence_generator import SequenceGenerator
from posenc_fairseq.models.common import fairseq_input_positions
from test_workflows import save_checkpoint
from util import TINY_ROBERTA, TINY_TRANSFORMER, build_model, random_batch


def stock_and_sinusoidal(data, options=()):
    """Stock `transformer` and `transformer_sinusoidal` built from one seed with `options`, in eval mode,
    checked to hold the same weights (ours also its encoding's) and to give the same outputs on a batch;
    (stock, ours, task, our args, the batch)."""
    torch.manual_seed(0)
    stock, task, _ = build_model(data, "transformer", [*TINY_TRANSFORMER, *options])
    torch.manual_seed(0)
    ours, _, args = build_model(data, "transformer_sinusoidal", [*TINY_TRANSFORMER, *options])
    ours_state = {k: v for k, v in ours.state_dict().items() if not k.startswith("positional_encoding.")}
    assert ours_state.keys() == stock.state_dict().keys()
    assert all(torch.equal(ours_state[k], v) for k, v in stock.state_dict().items())
    stock.eval(), ours.eval()
    batch = random_batch(task.source_dictionary, batch=4, src_len=9, tgt_len=7)
    with torch.no_grad():
        assert (stock(*batch)[0] - ours(*batch)[0]).abs().max() <= 1e-5
    return stock, ours, task, args, batch


def test_transformer_sinusoidal_is_the_stock_transformer(translation_data):
    stock, ours, task, _, (src, src_lengths, prev) = stock_and_sinusoidal(translation_data)
    with torch.no_grad():
        sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
        outputs = []
        for model in (stock, ours):
            model.decoder.set_beam_size(3)  # fairseq's beamable cross-attention (one source copy per beam group)
            generator = SequenceGenerator([model], task.target_dictionary, beam_size=3, max_len_b=12,
                                          search_strategy=search.BeamSearch(task.target_dictionary))
            outputs.append(generator.generate([model], sample))
    for stock_hypos, our_hypos in zip(*outputs):
        assert len(stock_hypos) == len(our_hypos) == 3
        for a, b in zip(stock_hypos, our_hypos):
            assert torch.equal(a["tokens"], b["tokens"])
            assert abs(float(a["score"]) - float(b["score"])) <= 1e-5


def test_no_cross_attention_builds_stock_decoder_layers(translation_data):
    """--no-cross-attention (fairseq's TransformerConfig) builds decoder layers without encoder-decoder
    attention, as stock does: the same weights, no encoder_attn, and outputs equal to stock's."""
    stock, ours, _, _, _ = stock_and_sinusoidal(translation_data, ["--no-cross-attention"])
    assert all(layer.encoder_attn is None for layer in stock.decoder.layers)
    assert all(layer.encoder_attn is None for layer in ours.decoder.layers)


@pytest.mark.parametrize("size", ["_base", "_prenorm"])
def test_roberta_learned_is_stock_roberta(masked_lm_data, size):
    torch.manual_seed(0)
    stock, task, _ = build_model(masked_lm_data, f"roberta{size}", TINY_ROBERTA, task="masked_lm")
    torch.manual_seed(0)
    ours, _, _ = build_model(masked_lm_data, f"roberta_learned{size}", TINY_ROBERTA, task="masked_lm")
    assert ours.state_dict().keys() - stock.state_dict().keys() <= {"positional_encoding.trained_with"}
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in stock.state_dict().items())
    stock.eval(), ours.eval()
    tokens = torch.randint(task.source_dictionary.nspecial, len(task.source_dictionary), (3, 11))
    with torch.no_grad():
        assert (stock(tokens)[0] - ours(tokens)[0]).abs().max() <= 1e-5


def test_fairseq_input_position_flags_build_what_stock_builds(translation_data):
    """fairseq's own --no-token-positional-embeddings and --*-learned-pos are honoured where
    --input-positions is not given (before, the encoding's default silently replaced them):
    transformer_sinusoidal without input embedding is stock `transformer` without it, weights and
    outputs; T5 with both learned flags gets learned tables, with one fairseq's mix. A stored
    value that is not a choice is refused when the model is built, and so are flags that contradict
    --input-positions."""
    from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
    from posenc_fairseq.encodings.option_types import OptionValueError
    from posenc_fairseq.models.common import set_position_defaults

    _, ours, _, args, _ = stock_and_sinusoidal(translation_data, ["--no-token-positional-embeddings"])
    assert args.input_positions == "none" and ours.encoder.embed_positions is None
    for flags, expected, kinds in [
            (["--encoder-learned-pos", "--decoder-learned-pos"], "learned", (LearnedPositionalEmbedding,) * 2),
            (["--encoder-learned-pos"], "stock", (LearnedPositionalEmbedding, SinusoidalPositionalEmbedding)),
            (["--encoder-learned-pos", "--input-positions", "learned"], "learned", (LearnedPositionalEmbedding,) * 2),
            ([], "none", (type(None),) * 2)]:  # T5's own choice
        model, _, args = build_model(translation_data, "transformer_t5", [*TINY_TRANSFORMER, *flags])
        assert args.input_positions == expected, flags
        assert (type(model.encoder.embed_positions), type(model.decoder.embed_positions)) == kinds, flags
    args.input_positions = "bogus"  # as a stored config or --model-overrides would give it
    with pytest.raises(OptionValueError, match=r"^--input-positions bogus: expected one of none, sinusoidal"):
        set_position_defaults(args, "t5")
    args.input_positions, args.input_positions_flags = "none", "bogus"
    with pytest.raises(OptionValueError, match=r"^--input-positions-flags bogus: expected one of none, sinusoidal"):
        set_position_defaults(args, "t5")
    for flags in (["--encoder-learned-pos", "--input-positions", "none"],
                  ["--no-token-positional-embeddings", "--input-positions", "sinusoidal"]):
        with pytest.raises(OptionValueError, match=r"^--input-positions \w+ contradicts fairseq's --"):
            build_model(translation_data, "transformer_t5", [*TINY_TRANSFORMER, *flags])


@pytest.mark.parametrize("encoding", ["sinusoidal", "learned", "t5"])
def test_overriding_fairseqs_input_flags_of_a_checkpoint_is_refused_or_applied(translation_data, tmp_path, encoding):
    """A checkpoint stores its input embedding as input_positions and the fairseq flags it set: fairseq's
    loader with --model-overrides of those flags was silently overruled by the stored choice (the
    embedding stayed). Flags that ask something else are refused, naming what to override; an override
    of input_positions itself is applied, and the stored flags alone change nothing."""
    from posenc_fairseq.encodings.option_types import OptionValueError

    torch.manual_seed(0)
    model, _, args = build_model(translation_data, f"transformer_{encoding}", TINY_TRANSFORMER)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(model, args, path)
    stored = args.input_positions
    assert stored == {"t5": "none"}.get(encoding, encoding)
    for overrides in ({"no_token_positional_embeddings": True}, {"encoder_learned_pos": True, "decoder_learned_pos": True}):
        if fairseq_input_positions(SimpleNamespace(**{**vars(args), **overrides})) == stored:
            continue  # (asks what it has: T5's stored --no-token-positional-embeddings wins over learned, as in stock)
        with pytest.raises(OptionValueError, match=rf"^--input-positions {stored} contradicts fairseq's --"):
            checkpoint_utils.load_model_ensemble([str(path)], arg_overrides=overrides)
    if encoding == "sinusoidal":
        (none,), _ = checkpoint_utils.load_model_ensemble([str(path)], arg_overrides={"input_positions": "none"})
        assert none.encoder.embed_positions is None and none.decoder.embed_positions is None
    if encoding == "learned":  # the trained tables have no place in the model: refused in one line
        with pytest.raises(OptionValueError, match=r"^--input-positions none: the checkpoint has a learned input "
                                                   r"position table \(decoder.embed_positions.weight\)"):
            checkpoint_utils.load_model_ensemble([str(path)], arg_overrides={"input_positions": "none"})
    if encoding == "t5":  # the model's learned tables would start untrained
        with pytest.raises(OptionValueError, match=r"^--input-positions learned: the model has a learned input "
                                                   r"position table \(decoder.embed_positions.weight\) that the "
                                                   r"checkpoint lacks"):
            checkpoint_utils.load_model_ensemble([str(path)], arg_overrides={"input_positions": "learned"})
    (again,), _ = checkpoint_utils.load_model_ensemble([str(path)])  # the stored flags are its own: no conflict
    assert again.encoder.embed_positions.__class__ is model.encoder.embed_positions.__class__


LEARNED_TABLE_SIZES = {  # arch, task, build options, the override, the table it resizes, its option's words
    "source": ("transformer_learned", "translation", [*TINY_TRANSFORMER, "--max-source-positions", "40"],
               {"max_source_positions": 64}, "encoder.embed_positions.weight", "--max-source-positions 64: "),
    "target": ("transformer_learned", "translation", TINY_TRANSFORMER, {"max_target_positions": 2048},
               "decoder.embed_positions.weight", "--max-target-positions 2048: "),
    "roberta": ("roberta_learned", "masked_lm", [*TINY_ROBERTA, "--max-positions", "40"], {"max_positions": 20},
                "encoder.sentence_encoder.embed_positions.weight", "--max-positions 20: "),
    "lm": ("transformer_lm_learned", "language_modeling", ["--decoder-layers", "1", "--decoder-embed-dim", "16",
                                                           "--tokens-per-sample", "40"],
           {"max_target_positions": 64}, "decoder.embed_positions.weight",
           "--max-target-positions 64 (by default --tokens-per-sample): "),
}


@pytest.mark.parametrize("case", sorted(LEARNED_TABLE_SIZES))
def test_a_learned_table_of_another_size_is_refused_naming_the_option(translation_data, masked_lm_data, tmp_path,
                                                                       case):
    """Loading a learned input table into a model of other maximum positions (fine-tuning on longer
    inputs) ended in torch's size mismatch; now one line names the option and the value that loads it."""
    from posenc_fairseq.encodings.option_types import OptionValueError

    arch, task, options, override, key, option = LEARNED_TABLE_SIZES[case]
    data = translation_data if task == "translation" else masked_lm_data
    torch.manual_seed(0)
    model, _, args = build_model(data, arch, options, task=task)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(model, args, path)
    (dest, asked), = override.items()
    stored = getattr(args, dest)
    with pytest.raises(OptionValueError, match="^" + re.escape(
            f"{option}the checkpoint's learned input position table ({key}) holds {stored} positions, this "
            f"model's {asked}; a learned table has a fixed size: give {option.split(' ')[0]} {stored}, for inputs "
            f"of at most {stored} tokens") + "$"):
        checkpoint_utils.load_model_ensemble([str(path)], arg_overrides=override)
    (again,), _ = checkpoint_utils.load_model_ensemble([str(path)], arg_overrides={dest: stored})
    assert torch.equal(again.state_dict()[key], model.state_dict()[key])


def test_quant_noise_touches_the_weights_stock_touches(translation_data):
    """--quant-noise-pq: fairseq's hook zeroes random blocks of a weight, in place, each time its module
    runs in training. Stock's fused self-attention path reads q/k/v/out_proj's weights without calling
    them (their hooks never run there); cross-attention and the FFN run theirs. A training step from
    one seed leaves our weights and loss equal to stock's."""
    options = ["--quant-noise-pq", "0.5", "--quant-noise-pq-block-size", "8"]
    stock, ours, task, _, (src, src_lengths, prev) = stock_and_sinusoidal(translation_data, options)
    losses = []
    for model in (stock, ours):
        model.train()
        torch.manual_seed(1)
        losses.append(model(src, src_lengths, prev)[0].float().pow(2).mean())
        losses[-1].backward()
    assert (losses[0] - losses[1]).abs() <= 1e-5
    ours_state = {k: v for k, v in ours.state_dict().items() if not k.startswith("positional_encoding.")}
    changed = [k for k, v in stock.state_dict().items() if not torch.equal(ours_state[k], v)]
    assert not changed, changed
    untouched = stock_and_sinusoidal(translation_data, options)[0].state_dict()
    noised = {k.split(".")[-2] for k, v in stock.state_dict().items() if not torch.equal(untouched[k], v)}
    assert "fc1" in noised and "q_proj" in noised  # (the FFN's and cross-attention's: the test sees noise)


@pytest.mark.parametrize("family,encoding", [*(("transformer", name) for name in ["t5", "at5", "shaw", "xl", "floater"]),
                                             ("transformer_lm", "t5"), ("transformer_lm", "floater"), ("roberta", "xl")])
def test_the_encoding_draws_from_its_own_random_stream(translation_data, masked_lm_data, family, encoding):
    """fairseq-generate and fairseq-train seed torch before building the model: the encoding's
    initialisation must not move the global stream, or a converted checkpoint samples (and drops out)
    otherwise than its stock source with the same --seed. The encoding's initial values still follow
    the seed: the same seed gives the same values, another seed others. Every model family (the
    decoder-only one builds its encoding apart)."""
    data, options, task = {
        "transformer": (translation_data, TINY_TRANSFORMER, "translation"),
        "transformer_lm": (masked_lm_data, ["--decoder-layers", "2", "--decoder-embed-dim", "32",
                                            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4"],
                           "language_modeling"),
        "roberta": (masked_lm_data, TINY_ROBERTA, "masked_lm")}[family]

    def built(arch, seed):
        torch.manual_seed(seed)
        # (RoBERTa's stock input embedding is a learned table: drawn as stock's where kept, as converted)
        ours = ["--input-positions", "stock"] if arch.startswith("roberta_") and arch != "roberta_base" else []
        model, _, _ = build_model(data, arch, [*options, *ours], task=task)
        return model, torch.rand(8)  # what the next draw (dropout, sampling) gets

    _, stock_next = built({"roberta": "roberta_base"}.get(family, family), 0)
    model, next_draw = built(f"{family}_{encoding}", 0)
    assert torch.equal(next_draw, stock_next)
    again, _ = built(f"{family}_{encoding}", 0)
    other, _ = built(f"{family}_{encoding}", 1)
    ours, same, different = (dict(m.positional_encoding.named_parameters()) for m in (model, again, other))
    assert ours and all(torch.equal(ours[name], same[name]) for name in ours)
    assert any(not torch.equal(ours[name], different[name]) for name in ours if ours[name].abs().sum() > 0)


@pytest.mark.parametrize("family", ["roberta", "transformer"])
def test_a_batch_padded_wider_than_a_learned_table_runs_as_stock(translation_data, masked_lm_data, family):
    """Padding takes no row of a learned table (fairseq numbers real tokens only): stock computes a batch
    padded to 20 tokens with a 16-position table while every row's tokens fit. Before, ours refused it
    by the batch's width (e.g. collate_tokens(pad_to_length=...)); a row of 17 tokens is still refused."""
    limit = ["--max-positions", "16"] if family == "roberta" else ["--max-source-positions", "16",
                                                                    "--max-target-positions", "16"]
    data, tiny, task_name = ((masked_lm_data, TINY_ROBERTA, "masked_lm") if family == "roberta"
                             else (translation_data, TINY_TRANSFORMER, "translation"))
    learned = [] if family == "roberta" else ["--encoder-learned-pos", "--decoder-learned-pos"]
    torch.manual_seed(0)
    stock, task, _ = build_model(data, family, [*tiny, *limit, *learned], task=task_name)
    torch.manual_seed(0)
    ours, _, _ = build_model(data, f"{family}_learned", [*tiny, *limit], task=task_name)
    stock.eval(), ours.eval()
    dictionary = task.source_dictionary
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (2, 20))
    tokens[:, 16:] = dictionary.pad()
    tokens[1, 10:] = dictionary.pad()

    def call(model, tokens):
        if family == "roberta":
            return model(tokens)[0]
        lengths = tokens.ne(dictionary.pad()).sum(dim=1)
        return model(tokens, lengths, tokens)[0]

    with torch.no_grad():
        ours_out = call(ours, tokens)
        assert (ours_out - call(stock, tokens)).abs().max() <= 1e-5
        assert (ours_out[:1, :16] - call(ours, tokens[:1, :16])).abs().max() <= 1e-5  # padding changes nothing
        tokens[0, 16] = dictionary.nspecial
        with pytest.raises(ValueError, match="input of 17 tokens exceeds the learned position table"):
            call(ours, tokens)
