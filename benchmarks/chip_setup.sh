# The lent TPU v5e host's setup for the LM benchmarks, sourced from the repository root:
#
#   OUT=/tmp/x source benchmarks/chip_setup.sh || exit
#
# Installs .whl-tpu/ (carried with the working tree; docs/tpu.md says how to make it) into
# /tmp/site, puts it and the checkout on PYTHONPATH, takes optax and toolz from the host's
# own index (without deps: JAX stays the host's), checks the imports before any device time
# is spent, and prepares the corpus in /tmp/lm-data (the whole standard library's sources,
# ~11 MB) unless it is there. Sets t0 (the setup's start, unix seconds) and makes $OUT.
mkdir -p "$OUT"
t0=$(date +%s)
if [ ! -d .whl-tpu ]; then
  echo "no .whl-tpu/ here: download the wheels as docs/tpu.md shows and carry the folder" >&2
  return 2
fi
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
  --no-compile --no-cache-dir --target /tmp/site .whl-tpu/*.whl >/dev/null 2>&1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD
for name in optax toolz; do  # from the host's index, without deps: JAX stays the host's
  python3 -c "import $name" 2>/dev/null || PIP_CONFIG_FILE=/dev/null python3 -m pip install \
    --isolated -q --no-deps --only-binary=:all: --no-cache-dir --target /tmp/site \
    --index-url file:///opt/pypi/simple "$name" >/dev/null 2>&1
done
if ! python3 -c "import optax, grain, orbax.checkpoint, array_record, grpc, sidecar" \
    2>"$OUT/imports.log"; then
  echo "missing packages (add their wheels to .whl-tpu):" >&2
  tail -3 "$OUT/imports.log" >&2
  return 2
fi
[ -f /tmp/lm-data/manifest.json ] || python3 examples/lm/prepare.py --out /tmp/lm-data 2>&1 \
  | tee "$OUT/prepare.log"
echo "setup took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/prepare.log"
