"""Deterministic synthetic data in the formats of the real data sets, for the demo and the tests
(real corpora and pretrained weights cannot be downloaded on every machine).

The toy translation task is learnable by a small model in a few minutes on CPU: each source word
maps to one target word and the target reverses the word order, so a model must use positions.
"""
import random
from pathlib import Path
from typing import List, Tuple

SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "vo", "ri", "pe", "du", "go", "ba"]


def vocabulary(size: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def parallel_corpus(count: int, min_len: int = 3, max_len: int = 12, vocab: int = 60, seed: int = 1
                    ) -> List[Tuple[str, str]]:
    """Pairs (source, target): target = reversed source with every word replaced by its partner."""
    source_words = vocabulary(vocab, seed=100)
    partner = dict(zip(source_words, [w.upper() for w in reversed(source_words)]))
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(source_words) for _ in range(rng.randint(min_len, max_len))]
        pairs.append((" ".join(words), " ".join(partner[w] for w in reversed(words))))
    return pairs


def write_parallel(directory: Path, splits: dict, src: str = "src", tgt: str = "tgt") -> Path:
    """splits: name -> list of pairs. Writes NAME.SRC / NAME.TGT (fairseq-preprocess layout)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        (directory / f"{name}.{src}").write_text("".join(s + "\n" for s, _ in pairs))
        (directory / f"{name}.{tgt}").write_text("".join(t + "\n" for _, t in pairs))
    return directory


def monolingual_corpus(count: int, seed: int = 2, vocab: int = 80) -> List[str]:
    words = vocabulary(vocab, seed=200)
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(count)]


def wikitext_corpus(articles: int, seed: int = 3, vocab: int = 60, paragraphs: int = 3) -> str:
    """WikiText-style tokenised text (` = Title = ` headings, blank lines, paragraphs) for the
    language-model recipe. Learnable only with positions: a paragraph is a run of 3-word groups,
    each followed by its partner words at a distance of exactly 3 (`a b c A' B' C'`), so half of the
    tokens are predictable from the token 3 positions back and the rest are uniform."""
    words = vocabulary(vocab, seed=300)
    partner = dict(zip(words, [w.upper() for w in reversed(words)]))
    rng = random.Random(seed)
    lines = []
    for article in range(articles):
        lines += ["", f" = {rng.choice(words).capitalize()} {article} = ", ""]
        for _ in range(paragraphs):
            tokens = []
            for _ in range(rng.randint(3, 8)):
                group = [rng.choice(words) for _ in range(3)]
                tokens += group + [partner[w] for w in group]
            lines.append(" " + " ".join(tokens) + " . ")
        lines.append("")
    return "\n".join(lines) + "\n"
