#!/usr/bin/env bash
# Issues 77 and 78 on the lent TPU v5e, in two calls of the device (each cut at LIMIT=560 s
# from the script's start; every benchmark writes its JSON as it goes):
#
#   OUT=... bash benchmarks/chip_feed_hang.sh feed    # the feed's core sweep, then the hang
#   OUT=... bash benchmarks/chip_feed_hang.sh vision  # the vision example against its bound
#
# from the repository root, with .whl-tpu/ carried (docs/tpu.md) and, for the hang's before
# and after, an older tree at .before/ (its sidecar, pipelines, tests/support: `git archive
# REV sidecar pipelines tests/support tests/__init__.py | tar -x -C .before`).
#   feed    benchmarks.feed --transform heavy (JPEG decode, random-resized crop, flip) at
#           N = 1, 4, 12 cores: the one-core rate, N bare processes, ours with workers=N,
#           Grain mp_prefetch(N), Grain in-process; then benchmarks.stall_stop: a trainer
#           holding the chip hangs in a blocked call under --stall-timeout 5, 2 rounds of
#           this tree and of .before/ alternately (found after the timeout, stopped after
#           found, the new life and its first step after the stop)
#   vision  benchmarks.vision --config chip (ViT-B/16, 224x224, 128 images a step) under
#           `sidecar launch`: its device-resident bound, ours at N = 1, 2, 4, 12 workers,
#           Grain in-process, Grain mp_prefetch(N) at N = 2, 4, 12
set -uo pipefail
what=${1:?usage: bash benchmarks/chip_feed_hang.sh feed|vision}
OUT=${OUT:-/tmp/chip-feed-hang}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
t0=$(date +%s)
left() { echo $(( ${LIMIT:-560} - ($(date +%s) - t0) )); }
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
  --no-compile --no-cache-dir --target /tmp/site .whl-tpu/*.whl >/dev/null 2>&1
for name in optax toolz pillow; do  # from the host's own index: JAX stays the host's
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps \
    --only-binary=:all: --no-cache-dir --target /tmp/site \
    --index-url file:///opt/pypi/simple "$name" >/dev/null 2>&1
done
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
python3 -c "import grain, grpc, PIL, optax, sidecar, pipelines.vision" 2>"$OUT/imports.log" \
  || { tail -3 "$OUT/imports.log"; exit 2; }
echo "setup $(( $(date +%s) - t0 )) s, $(nproc) cores" | tee "$OUT/$what.log"
case "$what" in
  hang)
    timeout "$(left)" python3 -m benchmarks.stall_stop --rounds 2 --stall-timeout 5 \
      --before .before 2>&1 | tee -a "$OUT/$what.log" ;;
  feed)
    timeout $(( $(left) - 200 )) python3 -m benchmarks.feed --transform heavy --cores 1,4,12 \
      --seconds 4 --warmup 3 --out "$OUT" 2>&1 | grep -v -i warn | tee -a "$OUT/$what.log"
    timeout "$(left)" python3 -m benchmarks.stall_stop --rounds 2 --stall-timeout 5 \
      --before .before 2>&1 | tee -a "$OUT/$what.log" ;;
  vision)
    [ -f /tmp/vision-data/manifest.json ] || python3 examples/vision/prepare.py \
      --out /tmp/vision-data --images 4096 --jobs 12 2>&1 | tee -a "$OUT/$what.log"
    timeout "$(left)" python3 -m sidecar launch --hosts 1 --import pipelines.vision \
      --shm-size 8GiB -- python3 -m benchmarks.vision --config chip --data /tmp/vision-data \
      --out "$OUT/vision.json" --workers 1,2,4,12 --grain-mp 2,4,12 --steps 30 --warmup 5 \
      2>&1 | grep -v -i warn | tee -a "$OUT/$what.log" ;;
  *) echo "usage: bash benchmarks/chip_feed_hang.sh feed|vision" >&2; exit 2 ;;
esac
echo "$(( $(date +%s) - t0 )) s in all" | tee -a "$OUT/$what.log"
