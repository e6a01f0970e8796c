#!/usr/bin/env python
"""Convert a stock fairseq roberta checkpoint into a posenc_fairseq one with equal outputs.

    python scripts/convert_roberta_checkpoint.py SRC DST [--encoding NAME] [encoding options]

See docs/conversion.md; the conversion itself is posenc_fairseq.convert.convert_checkpoint.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from posenc_fairseq.cli_signals import end_on_terminate  # noqa: E402
from posenc_fairseq.convert_cli import main  # noqa: E402

if __name__ == "__main__":
    end_on_terminate()
    sys.exit(main("roberta"))
