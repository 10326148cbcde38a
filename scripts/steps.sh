# scripts/steps.sh — sourced by the README commands' scripts: each long step says what it does
# before it starts and how long it took when it ends, wall and CPU (user + sys of the commands it
# ran and waited for; a background job counts where it is waited for), so no step is a silent
# wait and the next change can see where the two cores went.
#
#   . "$(dirname "$0")/steps.sh"
#   step build "every target (15-25 min on 2 cores)"    # ==> build: every target (...)
#   ...                                                  # <== build: 812 s, 1590 s CPU (at the next step or the end)
STEP_NAME=""
STEP_T0=0
STEP_CPU0=0
# CPU seconds of this shell's finished children (bash's `times`, second line: user sys) into
# STEP_CPU. `times` must run in this shell itself: a pipe or $(...) runs it in a forked subshell,
# whose children are none (every step then read 0 s of CPU); so it writes to a file.
STEP_TIMES_FILE=$(mktemp "${TMPDIR:-/tmp}/kvscore-steps.XXXXXX")
step_cpu() {
  times >"$STEP_TIMES_FILE"
  STEP_CPU=$(awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); s += a[1] * 60 + a[2] } printf "%d", s }' "$STEP_TIMES_FILE")
}
step_done() {
  if [ -n "$STEP_NAME" ]; then
    step_cpu
    printf '<== %s: %d s, %d s CPU\n' "$STEP_NAME" "$(($(date +%s) - STEP_T0))" "$((STEP_CPU - STEP_CPU0))"
    STEP_NAME=""
  fi
}
step() {
  step_done
  STEP_NAME=$1
  STEP_T0=$(date +%s)
  step_cpu
  STEP_CPU0=$STEP_CPU
  shift
  printf '==> %s: %s\n' "$STEP_NAME" "$*"
}
trap 'step_done; rm -f "$STEP_TIMES_FILE"' EXIT
