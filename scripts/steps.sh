# scripts/steps.sh — sourced by the README commands' scripts: each long step says what it does
# before it starts and how long it took when it ends, so no step is a silent wait.
#
#   . "$(dirname "$0")/steps.sh"
#   step build "every target (15-25 min on 2 cores)"    # ==> build: every target (...)
#   ...                                                  # <== build: 812 s (at the next step or the end)
STEP_NAME=""
STEP_T0=0
step_done() {
  if [ -n "$STEP_NAME" ]; then
    printf '<== %s: %d s\n' "$STEP_NAME" "$(($(date +%s) - STEP_T0))"
    STEP_NAME=""
  fi
}
step() {
  step_done
  STEP_NAME=$1
  STEP_T0=$(date +%s)
  shift
  printf '==> %s: %s\n' "$STEP_NAME" "$*"
}
trap step_done EXIT
