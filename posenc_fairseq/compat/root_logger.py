"""Put the root logger back after importing fairseq-fixed 0.12.3.1 configures it.

Three of fairseq's modules call `logging.basicConfig` when imported (level DEBUG in
models/wav2vec/wav2vec2_classification.py, INFO in tasks/text_to_speech.py and
tasks/frm_text_to_speech.py), and `import fairseq` imports them all: a plain `import posenc_fairseq`
would print every library's debug messages. When the plugin is what first imports fairseq, the
root logger's level and handlers are put back as they were, so the import changes no logging the
user did not ask for. When fairseq is already imported (its commands, which configure logging
themselves first, then import the --user-dir), there is nothing of ours to undo.

No model is affected: only the root logger, and only at import.
"""
import logging
import sys


def apply():
    if "fairseq" in sys.modules:
        return None
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    # every model and task: no later fairseq import runs basicConfig again
    import fairseq

    added = [handler for handler in root.handlers if handler not in handlers]
    if root.level == level and not added:
        return None
    changed_to = logging.getLevelName(root.level)
    for handler in added:
        root.removeHandler(handler)
    root.setLevel(level)
    return (f"importing fairseq {fairseq.__version__} configures the root logger (logging.basicConfig: level "
            f"{changed_to}, {len(added)} handler(s) added); put back as it was")
