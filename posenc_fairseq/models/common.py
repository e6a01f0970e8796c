"""What the translation and RoBERTa models share: options, stacks that tell the encoding the
token positions, and attaching one encoding to a model."""
import argparse

import torch
from torch import Tensor

from fairseq.models import register_model_architecture
from fairseq.models.transformer import TransformerDecoder, TransformerEncoder
from fairseq.modules import LearnedPositionalEmbedding

from ..attention import use_positional_attention
from ..encodings import ENCODINGS, ModelDims, build_encoding

INPUT_POSITIONS = ("none", "sinusoidal", "learned", "stock")


def add_position_args(parser: argparse.ArgumentParser):
    parser.add_argument("--positional-encoding", choices=sorted(ENCODINGS), metavar="NAME",
                        help="position information inside attention: " + ", ".join(sorted(ENCODINGS)))
    parser.add_argument("--input-positions", choices=INPUT_POSITIONS,
                        help="absolute embedding added to the input tokens (fairseq's own modules); "
                             "'stock' keeps the base architecture's; default: the encoding's choice")
    for name in sorted(ENCODINGS):
        ENCODINGS[name].add_args(parser)


def set_position_defaults(args, encoding: str):
    """Architecture defaults; must run before fairseq's base architecture fills in the rest."""
    args.positional_encoding = getattr(args, "positional_encoding", None) or encoding
    choice = getattr(args, "input_positions", None) or ENCODINGS[args.positional_encoding].default_input_positions
    args.input_positions = choice
    if choice == "none":
        args.no_token_positional_embeddings = True
    elif choice in ("sinusoidal", "learned"):
        args.no_token_positional_embeddings = False
        args.encoder_learned_pos = args.decoder_learned_pos = choice == "learned"


def token_positions(tokens: Tensor, padding_idx: int) -> Tensor:
    """0-based position of each token among the non-padding tokens of its row (pads get 0), so
    left- and right-padded batches give every real token the same position."""
    real = tokens.ne(padding_idx)
    return ((real.cumsum(dim=1) - 1) * real).long()


def check_length(embed_positions, length: int, limit: int):
    """A learned absolute table cannot extrapolate: say so instead of an IndexError deep inside."""
    if isinstance(embed_positions, LearnedPositionalEmbedding) and length > limit:
        raise ValueError(f"input of {length} tokens exceeds the learned position table ({limit} positions); "
                         "use --input-positions none/sinusoidal or a larger --max-*-positions")


class PositionalTransformerEncoder(TransformerEncoder):
    """fairseq's encoder with PositionalAttention; tells the encoding the source positions."""

    def __init__(self, args, dictionary, embed_tokens, return_fc=False):
        super().__init__(args, dictionary, embed_tokens, return_fc=return_fc)
        use_positional_attention(self)
        self.__dict__["encoding"] = None  # owned (and saved) by the model, not by this stack

    def bind_encoding(self, encoding):
        self.__dict__["encoding"] = encoding
        for index, layer in enumerate(self.layers):
            layer.self_attn.bind_position(encoding, "encoder", index)

    def forward(self, src_tokens, *args, **kwargs):
        check_length(self.embed_positions, src_tokens.size(1), self.max_source_positions)
        if self.encoding is not None:
            self.encoding.begin("encoder", token_positions(src_tokens, self.padding_idx))
        return super().forward(src_tokens, *args, **kwargs)


class PositionalTransformerDecoder(TransformerDecoder):
    """fairseq's decoder with PositionalAttention; tells the encoding the target positions of
    this call (the current step during incremental decoding) and the source positions."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        use_positional_attention(self)
        self.__dict__["encoding"] = None

    def bind_encoding(self, encoding):
        self.__dict__["encoding"] = encoding
        for index, layer in enumerate(self.layers):
            layer.self_attn.bind_position(encoding, "decoder", index)
            if layer.encoder_attn is not None:
                layer.encoder_attn.bind_position(encoding, "cross", index)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        check_length(self.embed_positions, prev_output_tokens.size(1), self.max_target_positions)
        if self.encoding is not None:
            positions = token_positions(prev_output_tokens, self.padding_idx)
            if incremental_state is not None:
                positions = positions[:, -1:]
            source = None
            if encoder_out is not None and len(encoder_out.get("encoder_padding_mask", [])) > 0:
                source_mask = encoder_out["encoder_padding_mask"][0]
                real = ~source_mask
                source = ((real.cumsum(dim=1) - 1) * real).long()
            elif encoder_out is not None and len(encoder_out.get("encoder_out", [])) > 0:
                length, batch = encoder_out["encoder_out"][0].shape[:2]
                source = torch.arange(length, device=positions.device).expand(batch, length)
            self.encoding.begin("decoder", positions, source)
        return super().extract_features(prev_output_tokens, encoder_out, incremental_state, **kwargs)


def attach_encoding(model, args, encoder_stack, decoder_stack=None):
    """Build the model's one encoding and bind every attention layer to it."""
    dims = ModelDims(
        embed_dim=args.encoder_embed_dim,
        heads=args.encoder_attention_heads,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers if decoder_stack is not None else 0,
    )
    if decoder_stack is not None and (args.decoder_embed_dim != args.encoder_embed_dim
                                      or args.decoder_attention_heads != args.encoder_attention_heads):
        raise ValueError("posenc_fairseq needs equal encoder/decoder embedding sizes and head counts")
    encoding = build_encoding(args.positional_encoding, args, dims)
    model.positional_encoding = encoding
    encoder_stack.bind_encoding(encoding)
    if decoder_stack is not None:
        decoder_stack.bind_encoding(encoding)
    if hasattr(encoding, "bind_model"):
        encoding.bind_model(model)
    return encoding


def register_architectures(model_name: str, prefix: str, sizes: dict):
    """Register `{prefix}_{encoding}{size suffix}` for every encoding and size: the encoding's
    defaults first, then fairseq's own size architecture fills in everything else."""

    def register(encoding, suffix, size_architecture):
        def architecture(args):
            set_position_defaults(args, encoding)
            size_architecture(args)

        register_model_architecture(model_name, f"{prefix}_{encoding}{suffix}")(architecture)

    for encoding in ENCODINGS:
        for suffix, size_architecture in sizes.items():
            register(encoding, suffix, size_architecture)
