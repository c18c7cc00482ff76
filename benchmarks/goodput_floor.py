"""The restart floor and the device-resident loop of ``benchmarks.goodput``, in one process.

  python -m benchmarks.goodput_floor --config tiny --spawned UNIX_TIME [--steps N]

Imports JAX, opens the device, puts a state of model.py's shapes and one batch
there, and runs model.py's step (compiled from JAX's persistent cache where
``JAX_COMPILATION_CACHE_DIR`` holds it, as every trainer of the benchmark has it):
nothing any framework adds. The time from ``--spawned`` (when the parent started this
process) to that first step's loss is the floor every restart pays. Then, with
``--steps``, the same step ``N`` more times on that batch, kept on the device, with no
feed and no saves, each loss read as train.py reads it (after the next step is queued):
the steps/s the feed and the saves are held against.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def device_state(config_name: str, devices):
  """model.py's state and one batch of ``config_name`` on ``devices`` (ready), and its
  train step. Put from numpy, not init_state: its jit would add a compile of its own.
  Parameters random as init's (all-zero ones drive the moments into denormals, slow on
  CPU), optimizer state zeros as init's."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm"))
  import model
  config = model.CONFIGS[config_name]
  mesh = Mesh(np.array(devices), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  optimizer = model.make_optimizer(config)
  rng = np.random.default_rng(0)
  shapes = model.abstract_state(config, optimizer)
  host = {"step": np.zeros((), np.int32),
          "params": jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(
              s.dtype), shapes["params"]),
          "opt": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes["opt"])}
  state = jax.device_put(host, replicated)
  train_step = model.make_train_step(config, optimizer, state_sharding=replicated,
                                     batch_sharding=rows)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size,
                                             (config.batch_size, config.seq_len + 1))
  batch = jax.device_put({"tokens": tokens.astype(np.int32)}, rows)
  jax.block_until_ready((state, batch))
  return state, batch, train_step


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="tiny")
  parser.add_argument("--spawned", type=float, required=True,
                      help="unix time at which the parent started this process")
  parser.add_argument("--steps", type=int, default=0, help="device-resident steps to time")
  args = parser.parse_args(argv)
  marks = {"python": time.time()}
  import jax
  marks["import jax"] = time.time()
  devices = jax.devices()
  marks["devices"] = time.time()
  state, batch, train_step = device_state(args.config, devices)
  marks["state"] = time.time()
  state, loss = train_step(state, batch)
  float(loss.addressable_data(0))
  marks["first step"] = time.time()
  out = {"platform": devices[0].platform, "first_step_s": marks["first step"] - args.spawned,
         "phases_s": {}}
  before = args.spawned
  for name, t in marks.items():
    out["phases_s"][name] = t - before
    before = t
  if args.steps:
    pending = None
    t0 = time.perf_counter()
    for _ in range(args.steps):
      state, loss = train_step(state, batch)
      if pending is not None:
        float(pending.addressable_data(0))
      pending = loss
    float(pending.addressable_data(0))
    out["resident_steps"] = args.steps
    out["resident_steps_per_s"] = args.steps / (time.perf_counter() - t0)
  print(json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
