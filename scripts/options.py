#!/usr/bin/env python
"""Print the command-line options of each positional encoding, with their defaults and help.

    python scripts/options.py              # every encoding
    python scripts/options.py t5 floater   # only these (the names of `--positional-encoding`)

(`fairseq-train --arch transformer_NAME --help` cannot show them: fairseq 0.12 prints its help
before the model's options are added.) Every option below is accepted by `fairseq-train`,
`fairseq-generate` etc. with `--user-dir posenc_fairseq` and an architecture of this package.
"""
import argparse
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posenc_fairseq.encodings import ENCODINGS  # noqa: E402

COMMON = [
    ("--positional-encoding NAME", "set by the architecture (transformer_NAME*, transformer_lm_NAME*, roberta_NAME*)",
     "position information inside attention: " + ", ".join(sorted(ENCODINGS))),
    ("--input-positions none|sinusoidal|learned|stock", "the encoding's choice (below)",
     "absolute embedding added to the input tokens (fairseq's own modules); 'stock' keeps the base "
     "architecture's"),
    ("--allow-encoding-change", "off",
     "load weights (--restore-file, --finetune-from-model) trained with another encoding or other values of "
     "its options than this model's defaults, as a deliberate change; without it such a load is refused"),
]


def encoding_options(name: str):
    """[(flags, default, help)] of one encoding, from its own `add_args`."""
    parser = argparse.ArgumentParser(add_help=False)
    ENCODINGS[name].add_args(parser)
    options = []
    for action in parser._actions:
        flags = "/".join(action.option_strings)
        if action.choices:
            flags += " " + "|".join(map(str, action.choices))
        elif action.nargs == 0:
            pass  # a switch
        else:
            metavar = action.metavar or action.dest.upper()
            if action.nargs in ("+", "*"):
                metavar += " ..."
            elif isinstance(action.nargs, int) and action.nargs > 1:
                metavar = " ".join([metavar] * action.nargs) if isinstance(metavar, str) else " ".join(metavar)
            flags += f" {metavar}"
        help_text = action.help or ""
        if action.nargs == 0:
            default = "on" if action.default else "off"
        elif action.default is not None:
            default = str(action.default)
        else:
            # the encodings keep argparse defaults at None (so that architectures can tell "not
            # given") and state the effective default in the help text
            default = default_in_help(help_text, action.choices) or "see below"
        options.append((flags, default, help_text))
    return options


def default_in_help(text: str, choices=None) -> str:
    """'... default 32 (the paper's MT runs: 64); ...' -> '32 (the paper's MT runs: 64)';
    'zero (exactly the stock model, default) or small' -> 'zero'."""
    found = re.search(r"\bdefault:? (?=\S)", text)
    if found:
        depth, end = 0, found.end()
        while end < len(text):
            char = text[end]
            if char == "(":
                depth += 1
            elif char == ")":
                if depth == 0:
                    break
                depth -= 1
            elif depth == 0 and (char == ";" or text[end:end + 2] in (": ", ", ")):
                break
            end += 1
        value = text[found.end():end].strip().rstrip(".,")
        if value:
            return value
    marked = re.search(r"[(,] ?default\)", text)  # 'zero (exactly the stock model, default) or small'
    if marked and choices:
        before = {str(c): [m.start() for m in re.finditer(rf"\b{re.escape(str(c))}\b", text[:marked.start()])]
                  for c in choices}
        before = {c: max(found) for c, found in before.items() if found}
        if before:
            return max(before, key=before.get)  # the choice named last before the mark
    return ""


def describe(name: str) -> str:
    cls = ENCODINGS[name]
    lines = [f"{name}  (architectures transformer_{name}*, transformer_lm_{name}*, roberta_{name}*; "
             f"default --input-positions {cls.default_input_positions})"]
    options = encoding_options(name)
    if not options:
        lines.append("    no options of its own")
    for flags, default, help_text in options:
        lines.append(f"    {flags}")
        lines.append(f"        default: {default}")
        lines += textwrap.wrap(help_text, 96, initial_indent="        ", subsequent_indent="        ")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("encodings", nargs="*", metavar="ENCODING",
                        help="encoding names (default: all): " + ", ".join(sorted(ENCODINGS)))
    args = parser.parse_args(argv)
    unknown = [name for name in args.encodings if name not in ENCODINGS]
    if unknown:
        parser.error(f"unknown encoding(s) {', '.join(unknown)}; choose from {', '.join(sorted(ENCODINGS))}")
    print("Options of every architecture of this package:")
    for flags, default, help_text in COMMON:
        print(f"    {flags}\n        default: {default}")
        print(textwrap.fill(help_text, 96, initial_indent="        ", subsequent_indent="        "))
    for name in args.encodings or sorted(ENCODINGS):
        print()
        print(describe(name))


if __name__ == "__main__":
    main()
