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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, beside this file

import trainers  # noqa: E402

import sidecar  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  return trainers.parse(trainers.parser(
      __doc__.split("\n\n")[0],
      ckpt_help="checkpoint directory, under the sidecars' --checkpoint-root"), argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  sidecar.jax.initialize()  # before any other JAX call; a no-op for a job of one process
  import jax
  import model

  config = model.CONFIGS[args.config]
  optimizer, train_step, replicated, rows = trainers.data_parallel(config)
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
            trainers.write_metric(metrics, *pending)
          pending = (step, loss)
          if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step, state, data_state=feed.state())
        if pending is not None:
          trainers.write_metric(metrics, *pending)
    finally:
      ckpt.close()  # waits for the last save to be durable
  if me == 0:
    print(f"trained to step {step}; checkpoints {ckpt.all_steps()}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
