#!/usr/bin/env bash
# Issue 64 on the lent TPU v5e: the cost of each kind of failure (kill, error, hang) for
# both systems under the same launcher flags, against the floor; and the in-process
# recovery. Two commands, each one call of the device (600 s; cut at LIMIT=530 s from the
# script's start: SIGTERM, the benchmark stops its launchers and keeps the JSON so far):
#
#   bash benchmarks/goodput_chip_kinds.sh 1 [ARGS]  # the goodput by kind; ARGS to benchmarks.goodput
#   bash benchmarks/goodput_chip_kinds.sh 2         # restart_floor, then recover
#
# from the repository root, output under $OUT (default /tmp/goodput-chip-kinds). Needs
# .whl-tpu/ carried with the working tree (benchmarks/chip_setup.sh installs it and
# prepares the corpus). DRY_RUN=1 runs the same commands on CPU with the tiny config,
# short walls and the checkout's .venv (about 6 + 4 minutes on 2 cores), to check their
# mechanics before device time is spent.
#
# Part 1: benchmarks.goodput, --config chip, both systems with --standby (like for like:
# the launcher's, so the baseline gets it too) and --stall-timeout 20 (the chip's step
# is 0.142 s; the rule raises it to 10x the slowest step seen, a save's stall included),
# --failures kill,error,hang at seed 136, mtbf 35 s: a kill at 30.0 s, an error at 56.3 s,
# a hang at 76.2 s of each 120 s window (the seed picked among the first 200 so that ours
# has committed a save before the error, and ours' hang is found and restarted before
# the window closes; the baseline's hang, which nothing finds, last). The save intervals
# are the 1% rule's of the calibrated run of e4d56cf (ours 32, baseline 259), so the
# calibration is skipped and each system is first run to step 2 (the compilation cache);
# no reference run. Expected from the earlier runs (docs/tpu.md, 2026-12-06):
#   setup (install, corpus)                                   14-31 s
#   each system warmed to step 2                              ~106 s
#   2 x (120 s window + the launcher's stop, ~13 s)           ~266 s
#   the floor: a holder (start ~13 s, 100 resident steps
#   14 s) SIGKILLed, a fresh process to its first step ~14 s  ~45 s
#                                                             ~450 s in all
# Part 2: benchmarks.recover on one JAX compilation cache (only the first launch compiles
# cold, ~25 s): in-process rollbacks, 2 rounds each, step 33 raising (one step after a save:
# not staged yet, restored from its copies on the devices), step 40 (8 steps after: staged,
# not durable yet, restored from the RAM tier) and step 60 (no save in flight); then a
# restart and a standby restart at step 40, 1 round each. BEFORE=DIR runs the in-process
# rounds at steps 40 and 60 again from an older tree at DIR as well (its sidecar, examples
# and pipelines; this tree's benchmarks/recover.py copied into it), before and after in one
# run. FLOOR=1 first runs benchmarks.restart_floor --rounds 1 (a fresh and a standby round,
# ~80 s). Expected: setup 14-31 s; each launch 25-40 s; ~430 s with BEFORE.
set -uo pipefail
PART=${1:?usage: bash benchmarks/goodput_chip_kinds.sh 1|2 [ARGS]}
shift
OUT=${OUT:-/tmp/goodput-chip-kinds}
cd "$(dirname "$0")/.."
if [ -n "${DRY_RUN:-}" ]; then  # CPU: the same commands, the tiny config, short walls
  mkdir -p "$OUT"
  t0=$(date +%s)
  PY=${PY:-$PWD/.venv/bin/python} CONFIG=tiny DATA=${DATA:-/tmp/lm-data-dry}
  RUN=(--wall 60 --mtbf 12 --seed 35 --stall-timeout 8 --save-every ours=20
       --save-every baseline=100)
  RECOVER=(--save-every 10 --steps 40) FAIL_AT=(11 17 27)
  [ -f "$DATA/manifest.json" ] || $PY examples/lm/prepare.py --out "$DATA" --max-mb 2 >/dev/null
else
  source benchmarks/chip_setup.sh || exit 2
  PY=python3 CONFIG=chip DATA=/tmp/lm-data
  RUN=(--wall 120 --mtbf 35 --seed 136 --stall-timeout 20 --save-every ours=32
       --save-every baseline=259)
  RECOVER=(--save-every 32 --steps 64) FAIL_AT=(33 40 60)
fi
left() { echo $(( ${LIMIT:-530} - ($(date +%s) - t0) )); }
case $PART in
  1)
    timeout "$(left)" $PY -m benchmarks.goodput --config $CONFIG --failures kill,error,hang \
      --standby ours --standby baseline --no-reference "${RUN[@]}" --data "$DATA" \
      --out "$OUT" "$@" 2>&1 | tee "$OUT/goodput-kinds.log"
    code=${PIPESTATUS[0]}
    ;;
  2)
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache-recover}
    code=0
    if [ -n "${FLOOR:-}" ]; then
      timeout "$(left)" $PY -m benchmarks.restart_floor --config $CONFIG --rounds 1 \
        --preload optax 2>&1 | tee "$OUT/restart-floor.log"
      code=${PIPESTATUS[0]}
    fi
    recover() {  # TREE LOG ARGS: benchmarks.recover run from TREE, its output in $OUT/LOG
      local tree=$1 log=$2
      shift 2
      (cd "$tree" && timeout "$(left)" $PY -m benchmarks.recover --config $CONFIG \
        --data "$DATA" "$@") 2>&1 | tee "$OUT/$log"
      code=$(( code | PIPESTATUS[0] ))
    }
    for at in "${FAIL_AT[@]}"; do
      recover . "recover-$at.log" --ways in-process --rounds 2 --fail-at "$at" "${RECOVER[@]}"
    done
    if [ -n "${BEFORE:-}" ]; then
      for at in "${FAIL_AT[@]:1}"; do
        recover "$BEFORE" "recover-before-$at.log" --ways in-process --rounds 2 --fail-at "$at" \
          "${RECOVER[@]}"
      done
    fi
    recover . recover-restart.log --ways restart,standby --rounds 1 --fail-at "${FAIL_AT[1]}" \
      "${RECOVER[@]}"
    ;;
  *)
    echo "usage: bash benchmarks/goodput_chip_kinds.sh 1|2 [ARGS]" >&2
    exit 2
    ;;
esac
echo "part $PART: exit $code; $(( $(date +%s) - t0 )) s in all" | tee -a "$OUT/part$PART.log"
exit "$code"
