# What the recipes' shell scripts check before fairseq runs, and how they run it (sourced right after
# `set -euo pipefail`: `source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../recipe_checks.sh"`, then
# `help_if_asked "$@"`; realpath: a script run through a link finds it too).
# A missing folder or checkpoint is one error line, not a traceback deep in fairseq (nor, for a checkpoint to
# fine-tune, a silent training from scratch: fairseq-train only logs "No existing checkpoint found"). A recipe
# stopped by a signal stops its fairseq-train too.

# -h or --help as the first argument: the script's opening comment (what it does, its usage and
# environment), then exit; before, `--help` was taken for the first argument (a data folder, an OUT_DIR)
help_if_asked() {  # "$@"
  case "${1:-}" in
    -h|--help) sed -n '2,/^set -/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
  esac
}

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

# refused where INPUT is FOLDER or lies in it (links resolved: by another path it would go too), FOLDER being
# one the recipe removes or empties
need_outside() {  # INPUT FOLDER WHAT-THE-RECIPE-DOES-TO-FOLDER
  case "$(realpath -m "$1")/" in
    "$(realpath -m "$2")"/*) recipe_error "$1 is or lies in $2, which this recipe $3" ;;
  esac
}

# DEVICE: --cpu where CPU is set, else fp16 with the loss scaling of fairseq's RoBERTa fine-tuning recipes
set_device_options() {
  if [[ -n "${CPU:-}" ]]; then
    DEVICE=(--cpu)
  else
    DEVICE=(--fp16 --fp16-init-scale 4 --threshold-loss-scale 1 --fp16-scale-window 128)
  fi
}

# fairseq-train resumes from SAVE_DIR/checkpoint_last.pt (its way to continue a stopped run), whatever
# options this run has: said before it starts, so that a rerun with other settings is not taken for a new run
say_if_resuming() {  # SAVE_DIR
  if [[ -f "$1/checkpoint_last.pt" ]]; then
    echo "$(basename "$0"): $1 holds checkpoint_last.pt: fairseq-train resumes from it (remove $1 for a new run)" >&2
  fi
}

# COMMAND's output to the terminal and appended to LOG; a TERM, HUP or INT sent to the recipe is passed on to
# COMMAND as TERM, and the recipe exits with COMMAND's status. A foreground `COMMAND | tee` would be left
# running: bash runs a trap only after the foreground pipeline ends, and without a trap it exits at once.
# (COMMAND runs in the background, where bash makes it ignore INT, so a Ctrl-C reaches it through the trap.)
run_logged() {  # LOG COMMAND [ARGUMENTS...]
  { set +x; } 2>/dev/null  # the caller's trace has shown this call, COMMAND in full
  local log=$1 status=0
  shift
  exec 3> >(exec tee -a "$log")
  local tee_pid=$!
  "$@" >&3 2>&1 3>&- &
  local command_pid=$!
  trap "kill -TERM $command_pid 2>/dev/null" TERM HUP INT
  wait "$command_pid" || status=$?
  while kill -0 "$command_pid" 2>/dev/null; do  # the wait above was cut short by a trapped signal
    status=0
    wait "$command_pid" || status=$?
  done
  trap - TERM HUP INT
  exec 3>&-
  wait "$tee_pid" 2>/dev/null || true  # the log holds every line when the recipe ends
  return "$status"
}
