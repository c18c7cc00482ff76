#!/usr/bin/env bash
# The goodput benchmark (benchmarks/goodput.py) on the lent TPU v5e, in one command:
#
#   bash benchmarks/goodput_chip.sh [ARGS]  # from the repository root; output under $OUT
#
# ARGS go to benchmarks.goodput after the script's own (e.g. --save-every ours=20
# --save-every baseline=239: the intervals of an earlier run's calibration, which is then
# skipped, leaving time for the floor and the reference losses).
#
# Needs .whl-tpu/ carried with the working tree: benchmarks/chip_setup.sh installs it and
# prepares the corpus (the whole standard library's sources, ~11 MB: ~700 batches of the
# chip config an epoch, so the runs also cross epochs), then this runs the benchmark with
# the chip config (~101M parameters; params + Adam moments ~1.2 GB).
#
# Budget, <= 9 minutes of wall (estimates from docs/tpu.md: a process's JAX init ~7 s, the
# step's compile 2 s cold / 0.3 s from the cache, ~10 steps/s; restarts add the sidecar's
# or Orbax's restore of 1.2 GB):
#   install + prepare                                        ~25 s
#   calibration: 2 systems x (no saves, saves every 20), 80 steps each,
#     ~30 s a run (startup ~20 s + 8 s of steps + stop)    ~120 s
#     (every 20, not 10: 1.2 GB saves closer than Orbax writes them would measure its
#     back-pressure, not a save's cost)
#   2 systems x --wall 100 s with the kills                  200 s
#   the uninterrupted reference of ours, to the last step either reached:
#     startup ~20 s + at most ~90 s of steps                ~110 s
#   the floor twice (+ 100 device-resident steps)           ~30 s
#   launcher stops (SIGTERM, trainers and sidecars reaped)  ~15 s
#   total                                                   ~500 s; the benchmark is cut
#   (SIGTERM: it stops its launcher, keeps the JSON so far) at 530 s from the script's start
# --mtbf 60 with --seed 10: kills at 50.8 s and 84.4 s of each 100 s job (the schedule is
# drawn from the seed; this seed was picked among the first 30 so that both kills land
# after the first steps, and both systems get the same one). Wall and kills are few for
# goodput at one failure a minute: the figures are per failure, the ratios in one run.
# The results JSON is written after each phase, so a run cut short leaves what it measured.
set -uo pipefail
OUT=${OUT:-/tmp/goodput-chip}
cd "$(dirname "$0")/.."
source benchmarks/chip_setup.sh || exit 2
timeout $(( ${LIMIT:-530} - ($(date +%s) - t0) )) python3 -m benchmarks.goodput --config chip --wall 100 --mtbf 60 --seed 10 \
  --calibrate-steps 80 --calibrate-every 20 --data /tmp/lm-data --out "$OUT" "$@" 2>&1 | tee "$OUT/goodput.log"
echo "exit ${PIPESTATUS[0]}; $(( $(date +%s) - t0 )) s in all" | tee -a "$OUT/goodput.log"
