"""The vision example's training loop fed four ways: steps/s against its compute bound.

Run under ``sidecar launch`` from the repository root (one sidecar beside this process;
``benchmarks/vision_chip.sh`` does it on the lent TPU v5e)::

  sidecar launch --hosts 1 --import pipelines.vision -- \\
      python -m benchmarks.vision --config tiny --data /tmp/vision-data --out /tmp/vision.json

One process, one compiled step (``examples/vision/model.py``, donating its state), the
same loop for every row: a step per batch, each batch a device array of ``{"image":
uint8[b, s, s, 3], "label": int32[b]}``, two batches put ahead on the device, steps/s over
``--steps`` steps after ``--warmup``:

- ``bound``: one batch kept on the device (the compute bound: no input at all);
- ``sidecar N``: ``ctl.feed("vision", ..., FeedOptions(workers=N))``, the sidecar's N
  processes decoding (its own device prefetch thread);
- ``grain``: Grain in-process (``to_iter_dataset``, its default read threads);
- ``grain-mp N``: Grain ``mp_prefetch(N)``.

Also the pipeline's one-core rate (images/s of ``pipelines.vision.example`` in this
process), so each row can be read against N x that. The JSON (``--out``) is rewritten
after each row: a run cut short keeps what it measured. Not run by CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "vision"))

FIRST_BATCH_S = 120.0  # a path whose first batch takes longer is given up


class Decode:
  """``pipelines.vision.example`` as Grain's ``map_with_index`` calls it (picklable)."""

  def __init__(self, seed: int, image_size: int):
    self.seed, self.image_size = seed, image_size

  def __call__(self, index: int, record: Any) -> dict[str, np.ndarray]:
    from pipelines import vision
    return vision.example(record, index=index, seed=self.seed, image_size=self.image_size,
                          train=True)


def one_core_rate(data: str, image_size: int, seconds: float = 3.0) -> float:
  """Images/s of the pipeline's element function in this process."""
  from pipelines import vision
  records, decode = vision.Records(data), Decode(0, image_size)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    decode(n % len(records), records[n % len(records)])
    n += 1
  return n / (time.perf_counter() - t0)


def grain_batches(data: str, *, batch: int, image_size: int, workers: int):
  """Grain's iterator of numpy batches: in-process (``workers`` 0) or ``mp_prefetch``."""
  import grain

  from pipelines import vision
  ds = (grain.MapDataset.source(vision.Records(data)).shuffle(seed=0).repeat()
        .map_with_index(Decode(0, image_size)).batch(batch, drop_remainder=True)
        .to_iter_dataset())
  if workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return iter(ds)


def on_device(iterator, sharding, depth: int = 2):
  """``iterator``'s batches put on the device ``depth`` ahead (the puts are asynchronous)."""
  import jax
  ahead: collections.deque = collections.deque()
  while True:
    while len(ahead) < depth:
      ahead.append(jax.device_put(next(iterator), sharding))
    yield ahead.popleft()


def run(step_fn, state, batches, *, steps: int, warmup: int) -> tuple[Any, dict[str, float]]:
  """``warmup`` then ``steps`` steps on ``batches``: the state, and steps/s, images/s and
  the mean wait for a batch (ms)."""
  t0 = time.perf_counter()
  batch = next(batches)
  first_s = time.perf_counter() - t0
  loss = None
  for _ in range(warmup):
    state, loss = step_fn(state, batch)
    batch = next(batches)
  if loss is not None:
    loss.block_until_ready()
  waited, t0 = 0.0, time.perf_counter()
  for _ in range(steps):
    state, loss = step_fn(state, batch)
    w = time.perf_counter()
    batch = next(batches)
    waited += time.perf_counter() - w
  loss.block_until_ready()
  seconds = time.perf_counter() - t0
  return state, {"steps_per_s": steps / seconds, "wait_ms": waited / steps * 1e3,
                 "first_batch_s": first_s}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="tiny")
  p.add_argument("--data", required=True)
  p.add_argument("--out", required=True, help="the JSON of every row")
  p.add_argument("--workers", default="1,2,3,4,6,8,10,12",
                 help="the sidecar's worker counts, comma-separated")
  p.add_argument("--grain-mp", default="1,2,4,8,12",
                 help="Grain mp_prefetch's worker counts (empty: none)")
  p.add_argument("--no-grain", action="store_true", help="skip Grain in-process")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--prefetch", type=int, default=8, help="the sidecar feed's prefetch")
  args = p.parse_args(argv)
  import absl.flags
  absl.flags.FLAGS.mark_as_parsed()  # Grain's multiprocessing reads absl flags
  import jax
  import model
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import sidecar
  config = model.CONFIGS[args.config]
  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  optimizer = model.make_optimizer(config)
  step_fn = model.make_train_step(config, optimizer, state_sharding=replicated,
                                  batch_sharding=rows)
  state = model.init_state(config, optimizer, sharding=replicated)
  data = os.path.abspath(args.data)
  out: dict[str, Any] = {"config": args.config, "batch": config.batch_size,
                         "image_size": config.image_size, "device": str(jax.devices()[0]),
                         "train_tflop_per_step": config.train_flops() / 1e12, "rows": {}}

  def record(name: str, figures: dict[str, float]) -> None:
    figures["images_per_s"] = figures["steps_per_s"] * config.batch_size
    out["rows"][name] = figures
    bound = out["rows"].get("bound", {}).get("steps_per_s")
    ratio = f", {figures['steps_per_s'] / bound:.3f} of the bound" if bound else ""
    print(f"{name:>14}: {figures['steps_per_s']:7.2f} steps/s ({figures['images_per_s']:7.0f} "
          f"images/s), wait {figures['wait_ms']:6.1f} ms/step{ratio}", flush=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))

  out["one_core_images_per_s"] = one_core_rate(data, config.image_size)
  print(f"the pipeline on one core: {out['one_core_images_per_s']:.0f} images/s", flush=True)
  # The bound: a batch of the pipeline's kept on the device.
  first = next(grain_batches(data, batch=config.batch_size, image_size=config.image_size,
                             workers=0))
  resident = jax.device_put(first, rows)
  t0 = time.perf_counter()
  state, loss = step_fn(state, resident)
  loss.block_until_ready()
  out["first_step_s"] = time.perf_counter() - t0  # its compile
  state, figures = run(step_fn, state, iter(lambda: resident, None), steps=args.steps,
                       warmup=args.warmup)
  record("bound", figures)
  with sidecar.jax.Controller.from_env() as ctl:
    for n in [int(x) for x in args.workers.split(",") if x]:
      # replay=0: each feed opens at the start, where the one before kept its batches
      # (the same pipeline, arguments and seed): they would be served, not decoded.
      options = sidecar.FeedOptions(workers=n, prefetch=args.prefetch, replay=0)
      with ctl.feed("vision", global_batch_size=config.batch_size, sharding=rows,
                    kwargs={"data": data, "image_size": config.image_size},
                    options=options) as feed:
        state, figures = run(step_fn, state, feed, steps=args.steps, warmup=args.warmup)
      record(f"sidecar {n}", figures)
  if not args.no_grain:
    state, figures = run(step_fn, state, on_device(grain_batches(
        data, batch=config.batch_size, image_size=config.image_size, workers=0), rows),
        steps=args.steps, warmup=args.warmup)
    record("grain", figures)
  for n in [int(x) for x in args.grain_mp.split(",") if x]:
    batches = grain_batches(data, batch=config.batch_size, image_size=config.image_size,
                            workers=n)
    state, figures = run(step_fn, state, on_device(batches, rows), steps=args.steps,
                         warmup=args.warmup)
    del batches
    record(f"grain-mp {n}", figures)
  return 0


if __name__ == "__main__":
  sys.exit(main())
