#!/usr/bin/env bash
# The vision example (examples/vision) on the lent TPU v5e, one measurement a call:
#
#   OUT=... bash benchmarks/vision_chip.sh sweep [ARGS]   # steps/s: the bound, ours, Grain at N
#   OUT=... bash benchmarks/vision_chip.sh replay [ARGS]  # waits of re-done steps
#
# ARGS go to the benchmark after the script's own (e.g. replay --ways kill, then another
# call with --ways rollback: the two ways together may not fit one call).
# from the repository root, with .whl-tpu/ carried (docs/tpu.md; Pillow's wheel in it too,
# where the host's own index lacks it). Installs it, takes optax and toolz from the host's
# index, prepares 8,192 synthetic 320x320 JPEGs in /tmp/vision-data (--jobs 12) unless they
# are there, keeps JAX's compilation cache in /tmp/jax-cache (a restart compiles from it),
# then:
#   sweep   benchmarks.vision under `sidecar launch`: the chip config (ViT-B/16, 224x224,
#           128 images a step), its device-resident bound, ctl.feed at N = 1..12 workers,
#           Grain in-process, Grain mp_prefetch(N) at N = 1, 2, 4, 8, 12; $OUT/vision.json
#   replay  benchmarks.replay: examples/vision/train.py --config chip, 6 feed workers, saves
#           every 25 steps, fails at step 45 (SIGKILL; an in-process rollback), with the
#           sidecar's kept batches and without (--replay 0); $OUT/replay.json
# Each is cut at LIMIT=560 s from the script's start (the JSON is written after each row).
set -uo pipefail
what=${1:-sweep}
OUT=${OUT:-/tmp/vision-chip}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
t0=$(date +%s)
if [ ! -d .whl-tpu ]; then
  echo "no .whl-tpu/ here: download the wheels as docs/tpu.md shows and carry the folder" >&2
  exit 2
fi
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
  --no-compile --no-cache-dir --target /tmp/site .whl-tpu/*.whl >/dev/null 2>&1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD
for name in optax toolz; do  # from the host's index, without deps: JAX stays the host's
  python3 -c "import $name" 2>/dev/null || PIP_CONFIG_FILE=/dev/null python3 -m pip install \
    --isolated -q --no-deps --only-binary=:all: --no-cache-dir --target /tmp/site \
    --index-url file:///opt/pypi/simple "$name" >/dev/null 2>&1
done
if ! python3 -c "import optax, grain, array_record, grpc, PIL, sidecar, pipelines.vision" \
    2>"$OUT/imports.log"; then
  echo "missing packages (add their wheels to .whl-tpu):" >&2
  tail -3 "$OUT/imports.log" >&2
  exit 2
fi
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
[ -f /tmp/vision-data/manifest.json ] || python3 examples/vision/prepare.py \
  --out /tmp/vision-data --images 8192 --jobs 12 2>&1 | tee "$OUT/prepare.log"
echo "setup took $(( $(date +%s) - t0 )) s ($(nproc) cores)" | tee -a "$OUT/prepare.log"
left=$(( ${LIMIT:-560} - ($(date +%s) - t0) ))
case "$what" in
  sweep)
    timeout "$left" python3 -m sidecar launch --hosts 1 --import pipelines.vision \
      --shm-size 8GiB -- python3 -m benchmarks.vision --config chip --data /tmp/vision-data \
      --out "$OUT/vision.json" --workers 1,2,3,4,5,6,8,10,12 --grain-mp 1,2,4,8,12 \
      --steps 30 --warmup 5 "${@:2}" 2>&1 | tee "$OUT/vision.log" ;;
  replay)
    timeout "$left" python3 -m benchmarks.replay --config chip --data /tmp/vision-data \
      --steps 70 --save-every 25 --fail-at 45 --workers 6 --shm-size 8GiB \
      --out "$OUT/replay.json" "${@:2}" 2>&1 | tee "$OUT/replay.log" ;;
  *) echo "usage: vision_chip.sh sweep|replay" >&2; exit 2 ;;
esac
echo "exit ${PIPESTATUS[0]}; $(( $(date +%s) - t0 )) s in all" | tee -a "$OUT/$what.log"
