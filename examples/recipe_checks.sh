# What the recipes' shell scripts check before fairseq runs (sourced: `source "$HERE/../recipe_checks.sh"`):
# a missing folder or checkpoint is one error line, not a traceback deep in fairseq (nor, for a checkpoint
# to fine-tune, a silent training from scratch: fairseq-train only logs "No existing checkpoint found").

recipe_error() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}

need_folder() {  # FOLDER WHAT
  [[ -d "$1" ]] || recipe_error "no folder $1 ($2)"
}

need_checkpoint() {  # FILE WHAT
  [[ -f "$1" ]] || recipe_error "no checkpoint file $1 ($2)"
}

# fairseq-train resumes from SAVE_DIR/checkpoint_last.pt (its way to continue a stopped run), whatever
# options this run has: said before it starts, so that a rerun with other settings is not taken for a new run
say_if_resuming() {  # SAVE_DIR
  if [[ -f "$1/checkpoint_last.pt" ]]; then
    echo "$(basename "$0"): $1 holds checkpoint_last.pt: fairseq-train resumes from it (remove $1 for a new run)" >&2
  fi
}
