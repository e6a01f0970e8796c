"""What fairseq does with a converted checkpoint (docs/conversion.md, "Resuming"): the converter
drops the optimizer state, and fairseq restores the update count, the lr scheduler and the
optimizer only together with it, so training from DST starts at update 0 with a fresh schedule;
the data iterator position (epoch) comes from the source unless --reset-dataloader, and
--finetune-from-model resets everything."""
import re
import sys

import torch

from util import QUICK_TRAIN, REPO, TINY_TRANSFORMER, USER_DIR, run

SCHEDULE = ["--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4", "--warmup-init-lr", "1e-7"]


def loaded(output):
    """(epoch, updates) of fairseq's 'Loaded checkpoint ... (epoch E @ U updates)' line."""
    found = re.search(r"Loaded checkpoint \S+ \(epoch (\d+) @ (\d+) updates\)", output)
    assert found, output[-3000:]
    return int(found.group(1)), int(found.group(2))


def first_epoch(output):
    """The epoch of the first training progress line (the data iterator's epoch)."""
    return int(re.search(r"\| train_inner \| epoch (\d+):", output).group(1))


def first_lr(output):
    return float(re.search(r"\| train_inner \|.*?lr=([0-9.e-]+)", output).group(1))


def test_converted_checkpoint_restarts_at_update_zero_with_a_fresh_warmup(translation_data, tmp_path):
    train = ["fairseq-train", translation_data, "--user-dir", USER_DIR, *TINY_TRANSFORMER, *QUICK_TRAIN, *SCHEDULE]
    source = tmp_path / "stock"
    run([*train, "--arch", "transformer", "--max-update", "6", "--save-dir", source])
    destination = tmp_path / "converted" / "checkpoint.pt"
    run([sys.executable, REPO / "scripts" / "convert_transformer_checkpoint.py", source / "checkpoint_last.pt",
         destination, "--encoding", "t5"])
    import posenc_fairseq  # noqa: F401  (safe globals)

    iterator = torch.load(destination, map_location="cpu")["extra_state"]["train_iterator"]
    assert iterator["epoch"] > 1  # the source's data iterator is past its first epoch

    # --restore-file DST (no --reset-optimizer: the surprising case): weights only; update 0, the
    # warm-up's first lr again; the data iterator continues the source's epoch
    out = run([*train, "--arch", "transformer_t5", "--input-positions", "stock", "--max-update", "2",
               "--save-dir", tmp_path / "b", "--restore-file", destination])
    assert loaded(out)[1] == 0 and first_epoch(out) == iterator["epoch"]
    assert "num_updates=1," in out and "num_updates 2" in out
    assert first_lr(out) < 5e-4  # warm-up from --warmup-init-lr (1/4 of --lr at update 1), not the source lr

    # --finetune-from-model DST: also the data iterator, meters and best score start afresh
    out = run([*train, "--arch", "transformer_t5", "--input-positions", "stock", "--max-update", "2",
               "--save-dir", tmp_path / "c", "--finetune-from-model", destination])
    assert loaded(out)[1] == 0 and first_epoch(out) == 1
