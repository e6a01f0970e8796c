"""Tiny data sets in the real on-disk formats of GLUE (TSV, per-task column layout), RACE (JSON files
under train/dev/test x middle/high) and WikiText-style raw text, for the recipe tests."""
import json
import random
from pathlib import Path

from posenc_fairseq.toy_data import vocabulary

# the words of toy_data.monolingual_corpus, so the tiny RoBERTa's dictionary covers them
WORDS = vocabulary(80, seed=200)


def sentence(rng, low=3, high=10):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _label(task, rng, sent1, sent2=None):
    """A learnable-ish label: depends on the first word."""
    key = WORDS.index(sent1.split()[0])
    if task == "STS-B":
        return f"{(key % 6) * 1.0 - rng.random() * 0.5 if key % 6 else 0.0:.3f}"
    if task == "MNLI":
        return ["entailment", "neutral", "contradiction"][key % 3]
    if task in ("QNLI", "RTE"):
        return ["entailment", "not_entailment"][key % 2]
    return str(key % 2)


def glue_rows(task, split, rng, n):
    """(header or None, rows) in the column layout of the real GLUE file for TASK/SPLIT."""
    test = split.startswith("test")
    rows = []
    for i in range(n):
        s1, s2 = sentence(rng), sentence(rng)
        label = _label(task, rng, s1, s2)
        if task == "CoLA":
            rows.append([str(i), s1] if test else ["gj04", label, "" if label == "1" else "*", s1])
        elif task == "SST-2":
            rows.append([str(i), s1] if test else [s1, label])
        elif task == "MRPC":
            rows.append([label, str(1000 + i), str(2000 + i), s1, s2])
        elif task == "QQP":
            rows.append([str(i), s1, s2] if test else [str(i), str(2 * i), str(2 * i + 1), s1, s2, label])
        elif task == "STS-B":
            rows.append([str(i), "main-news", "2012test", "2012", str(i), "none", "none", s1, s2]
                        + ([] if test else [label]))
        elif task == "MNLI":
            parses = [f"( {s1} )", f"( {s2} )", f"(ROOT {s1})", f"(ROOT {s2})"]
            head = [str(i), str(3 * i), f"{3 * i}e", "fiction", *parses, s1, s2]
            if test:
                rows.append(head)
            elif split == "train":
                rows.append(head + [label, label])
            else:
                rows.append(head + [label] * 5 + [label])
        elif task in ("QNLI", "RTE"):
            rows.append([str(i), s1, s2] + ([] if test else [label]))
    headers = {
        "CoLA": None, "SST-2": ["sentence", "label"],
        "MRPC": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
        "QQP": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        "STS-B": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
                  "sentence2", "score"],
        "MNLI": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                 "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"],
        "QNLI": ["index", "question", "sentence", "label"], "RTE": ["index", "sentence1", "sentence2", "label"],
    }
    header = headers[task]
    if test:
        header = {"CoLA": ["index", "sentence"], "SST-2": ["index", "sentence"],
                  "QQP": ["id", "question1", "question2"]}.get(task, header and header[:len(rows[0])])
    elif task == "MNLI" and split != "train":
        header = header[:10] + [f"label{k}" for k in range(1, 6)] + ["gold_label"]
    return header, rows


def write_glue(root: Path, task: str, n_train=64, n_dev=24, n_test=8, seed=0) -> Path:
    rng = random.Random(seed)
    folder = Path(root) / task
    folder.mkdir(parents=True, exist_ok=True)
    splits = {"train": n_train}
    if task == "MNLI":
        splits.update(dev_matched=n_dev, dev_mismatched=n_dev, test_matched=n_test, test_mismatched=n_test)
    else:
        splits.update(dev=n_dev, test=n_test)
    for split, n in splits.items():
        header, rows = glue_rows(task, split, rng, n)
        lines = ([header] if header and not (task == "CoLA" and not split.startswith("test")) else []) + rows
        (folder / f"{split}.tsv").write_text("".join("\t".join(row) + "\n" for row in lines))
    return Path(root)


def write_race(root: Path, per_level=(6, 2, 2), questions=2, seed=0) -> Path:
    """RACE layout: ROOT/{train,dev,test}/{middle,high}/N.txt, each a JSON document."""
    rng = random.Random(seed)
    for split, n in zip(("train", "dev", "test"), per_level):
        for level in ("middle", "high"):
            folder = Path(root) / split / level
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                article = "\n".join(sentence(rng, 5, 12) for _ in range(3))
                qs = [sentence(rng, 2, 5) + (" _ ." if q % 2 else " ?") for q in range(questions)]
                options = [[sentence(rng, 1, 3) for _ in range(4)] for _ in range(questions)]
                answers = [rng.choice("ABCD") for _ in range(questions)]
                doc = {"answers": answers, "options": options, "questions": qs, "article": article,
                       "id": f"{level}{k}.txt"}
                (folder / f"{k}.txt").write_text(json.dumps(doc))
    return Path(root)
