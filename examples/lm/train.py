"""Trains the byte-level LM of model.py on a prepared corpus, fed and checkpointed by sidecars.

From the repository root (examples/lm/README.md)::

  sidecar launch --hosts 1 --import pipelines.lm -- \\
      python examples/lm/train.py --config tiny --data /tmp/lm-data --ckpt /tmp/lm-ckpt \\
      --steps 300 --save-every 100 --metrics /tmp/lm-metrics.jsonl

One process per host (``sidecar launch --hosts N``), each driving its own devices; the
state is replicated over a "data" mesh axis of every device and each batch is split
over it (data parallel). Steps are numbered from 1: step n is the n-th update, its loss
is the loss of its batch before the update, and the checkpoint of step n holds the
state after n updates with the feed's position after n batches. A run restores the
latest checkpoint in ``--ckpt`` (from the sidecars' RAM tier where they hold it, else
storage) and trains on to ``--steps``; the steps after the restored one repeat the
losses of an uninterrupted run exactly on CPU. Process 0 appends one JSON line per step
to ``--metrics``: ``{"step": n, "loss": x, "time": unix seconds when step n's loss was
ready}``. Saves every ``--save-every`` steps and after the last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, beside this file

import sidecar  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="tiny", help="model.CONFIGS key: tiny or chip")
  parser.add_argument("--data", required=True, help="a corpus written by prepare.py")
  parser.add_argument("--ckpt", required=True,
                      help="checkpoint directory, under the sidecars' --checkpoint-root")
  parser.add_argument("--steps", type=int, required=True, help="train until this step")
  parser.add_argument("--metrics", required=True, help="JSON-lines file to append to")
  parser.add_argument("--save-every", type=int, default=100, help="steps between saves")
  parser.add_argument("--keep", type=int, default=3, help="checkpoints kept (max_to_keep)")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffle seed")
  args = parser.parse_args(argv)
  if args.save_every < 1 or args.steps < 1:
    parser.error("--steps and --save-every must be at least 1")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  sidecar.jax.initialize()  # before any other JAX call; a no-op for a job of one process
  import jax
  import model
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  config = model.CONFIGS[args.config]
  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  optimizer = model.make_optimizer(config)
  train_step = model.make_train_step(config, optimizer, state_sharding=replicated,
                                     batch_sharding=rows)
  me = jax.process_index()

  with sidecar.jax.Controller.from_env() as ctl:
    ckpt = ctl.checkpointer(os.path.abspath(args.ckpt), max_to_keep=args.keep)
    try:
      step = ckpt.latest_step()
      if step is None:
        step, data_state = 0, None
        state = model.init_state(config, optimizer, seed=args.seed, sharding=replicated)
      else:
        state = ckpt.restore(step, target=model.abstract_state(config, optimizer,
                                                                sharding=replicated))
        data_state = ckpt.data_state(step)
      if me == 0:
        print(f"pid {os.getpid()} {'restored step ' + str(step) if step else 'initialised'}: "
              f"{model.param_count(state['params']):,} parameters on {jax.device_count()} "
              f"device(s) in {jax.process_count()} process(es); training to step {args.steps}",
              flush=True)
      kwargs = {"data": os.path.abspath(args.data), "seq_len": config.seq_len}
      with (ctl.feed("lm", global_batch_size=config.batch_size, sharding=rows, seed=args.seed,
                     kwargs=kwargs, state=data_state) as feed,
            open(args.metrics if me == 0 else os.devnull, "a") as metrics):
        pending = None  # (step, loss): read once the next step is queued, so the device is busy
        while step < args.steps:
          batch = next(feed)
          state, loss = train_step(state, batch)
          step += 1
          if pending is not None:
            _write(metrics, *pending)
          pending = (step, loss)
          if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step, state, data_state=feed.state())
        if pending is not None:
          _write(metrics, *pending)
    finally:
      ckpt.close()  # waits for the last save to be durable
  if me == 0:
    print(f"trained to step {step}; checkpoints {ckpt.all_steps()}", flush=True)
  return 0


def _write(metrics, step: int, loss) -> None:
  value = float(loss.addressable_data(0))  # replicated: this process's copy
  metrics.write(json.dumps({"step": step, "loss": value, "time": time.time()}) + "\n")
  metrics.flush()


if __name__ == "__main__":
  sys.exit(main())
