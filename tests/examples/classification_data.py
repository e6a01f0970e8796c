"""Tiny IMDB (aclImdb folder of review files) and SNLI (snli_1.0 JSON lines) in their real on-disk
layouts, with the words of the tests' plain dictionary, for the classification recipe test."""
import json
import random
from pathlib import Path

from recipe_data import WORDS, sentence


def write_imdb(root: Path, per_label=(24, 12), seed=0) -> Path:
    """ROOT/aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt; the label follows the first word."""
    rng = random.Random(seed)
    for split, n in zip(("train", "test"), per_label):
        for label in ("pos", "neg"):
            folder = Path(root) / "aclImdb" / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                first = rng.choice(WORDS[:40] if label == "pos" else WORDS[40:])
                text = first + " " + sentence(rng, 8, 30) + " <br /><br />" + sentence(rng, 3, 10)
                (folder / f"{k}_{8 if label == 'pos' else 2}.txt").write_text(text)
    return Path(root) / "aclImdb"


def write_snli(root: Path, sizes=(48, 16, 16), seed=0) -> Path:
    """ROOT/snli_1.0/snli_1.0_{train,dev,test}.jsonl with gold_label, sentence1, sentence2 (a few '-')."""
    rng = random.Random(seed)
    folder = Path(root) / "snli_1.0"
    folder.mkdir(parents=True, exist_ok=True)
    labels = ["entailment", "neutral", "contradiction"]
    for split, n in zip(("train", "dev", "test"), sizes):
        lines = []
        for k in range(n):
            s1, s2 = sentence(rng), sentence(rng)
            gold = "-" if k % 10 == 9 else labels[WORDS.index(s2.split()[0]) % 3]
            lines.append(json.dumps({"annotator_labels": [gold], "captionID": f"{k}.jpg#0", "gold_label": gold,
                                     "pairID": f"{k}.jpg#0r1", "sentence1": s1, "sentence2": s2,
                                     "sentence1_parse": "", "sentence2_parse": ""}))
        (folder / f"snli_1.0_{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder
