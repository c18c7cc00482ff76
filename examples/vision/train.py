"""Trains the ViT of model.py on JPEGs decoded by the sidecar beside it, checkpointed by it.

From the repository root (examples/vision/README.md)::

  sidecar launch --hosts 1 --import pipelines.vision -- \\
      python examples/vision/train.py --config tiny --data /tmp/vision-data \\
      --ckpt /tmp/vision-ckpt --steps 200 --save-every 50 --metrics /tmp/vision.jsonl

The sidecar runs ``pipelines.vision`` (decode, random-resized crop, flip) in ``--workers``
processes and writes each batch into shared memory; this process normalizes and trains.
One process per host (``sidecar launch --hosts N``), the state replicated over a "data"
mesh axis of every device and each batch split over it. Steps are numbered from 1: step
n is the n-th update; process 0 appends ``{"step": n, "loss": x, "time": t, "wait": w}``
to ``--metrics`` (``w``: the seconds this process waited for step n's batch). A run
restores the latest checkpoint in ``--ckpt`` (the sidecar's RAM tier where it holds it)
and its feed position, and trains on to ``--steps``: the losses that follow are those of
an uninterrupted run, bit for bit on CPU. The steps re-done after a restart or an
in-process rollback (``--recover-in-process``) get their batches from the sidecar's
memory, not decoded again (``FeedOptions.replay``; ``--replay 0`` turns it off).
``--fail-at STEP`` raises in that step of the job's first start (to try a rollback);
``--inject-faults`` lets ``examples/lm/trainers.INJECT``'s signals make a step raise or hang.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # model.py, beside this file
sys.path.insert(1, str(HERE.parent / "lm"))  # trainers.py: the progress line, the faults

import trainers  # noqa: E402

import sidecar  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="tiny", help="model.CONFIGS key: tiny or chip")
  p.add_argument("--data", required=True, help="images written by prepare.py")
  p.add_argument("--ckpt", required=True,
                 help="checkpoint directory, under the sidecars' --checkpoint-root")
  p.add_argument("--steps", type=int, required=True, help="train until this step")
  p.add_argument("--metrics", required=True, help="JSON-lines file to append to")
  p.add_argument("--save-every", type=int, default=100, help="steps between saves")
  p.add_argument("--keep", type=int, default=3, help="checkpoints kept (max_to_keep)")
  p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
  p.add_argument("--workers", type=int, default=4,
                 help="feed worker processes decoding on each sidecar (0: the sidecar itself)")
  p.add_argument("--prefetch", type=int, default=4, help="batches each sidecar runs ahead")
  p.add_argument("--replay", type=int, default=sidecar.FeedOptions().replay,
                 help="batches each sidecar keeps since the last save, for re-done steps "
                      "(FeedOptions.replay; 0: none)")
  p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                 help="print a progress line this often; 0: never")
  p.add_argument("--recover-in-process", action="store_true",
                 help="a step that raises rolls back to the latest committed step in this "
                      "process (sidecar.jax.Recovery); the same step failing twice ends it")
  p.add_argument("--fail-at", type=int, default=0, metavar="STEP",
                 help="testing: raise in step STEP (after its batch is taken), in the job's "
                      "first start only (SIDECAR_RESTART 0); 0: never")
  p.add_argument("--inject-faults", action="store_true",
                 help="testing: a signal of trainers.INJECT makes the next step raise or hang")
  args = p.parse_args(argv)
  if args.save_every < 1 or args.steps < 1:
    p.error("--steps and --save-every must be at least 1")
  return args


def data_parallel(config):
  """``(optimizer, train_step, replicated, rows)``: the state replicated over a "data" mesh
  axis of every device, each batch's rows split over it."""
  import jax
  import model
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  optimizer = model.make_optimizer(config)
  train_step = model.make_train_step(config, optimizer, state_sharding=replicated,
                                     batch_sharding=rows)
  return optimizer, train_step, replicated, rows


def train(args, ckpt, feed, train_step, state, step: int, *, metrics, progress, recovery,
          injected) -> int:
  """Steps from ``step`` to ``args.steps``, saving every ``--save-every``; returns the last
  step. A step that raises goes to ``recovery`` (None: it ends the run)."""
  first_start = os.environ.get("SIDECAR_RESTART", "0") == "0"
  fail_left = 1 if args.fail_at > 0 and first_start else 0
  pending = None  # (step, loss, wait): read once the next step is queued
  progress.start(step)
  while step < args.steps:
    try:
      t0 = time.perf_counter()
      batch = next(feed)
      wait = time.perf_counter() - t0
      if step + 1 == args.fail_at and fail_left:
        fail_left -= 1
        print(f"fault: raising in step {step + 1} (--fail-at) at unix {time.time():.6f}",
              flush=True)
        raise RuntimeError(f"injected failure in step {step + 1} (--fail-at {args.fail_at})")
      injected.check(step + 1)
      state, loss = train_step(state, batch)
      if pending is not None:
        progress.step(pending[0], write_metric(metrics, *pending))
    except Exception as e:
      if recovery is None:
        raise
      state = batch = pending = None  # the failed state's memory, free for the restored one
      step, state = recovery.recover(e, step=step + 1)
      progress.start(step)
      continue
    step += 1
    pending = (step, loss, wait)
    if step % args.save_every == 0 or step == args.steps:
      ckpt.save(step, state, data_state=feed.state())
  if pending is not None:
    progress.step(pending[0], write_metric(metrics, *pending))
  return step


def write_metric(metrics, step: int, loss, wait: float) -> float:
  """Step ``step``'s line, the loss as this process's copy of it; returns the loss."""
  import json
  value = float(loss.addressable_data(0))
  metrics.write(json.dumps({"step": step, "loss": value, "time": time.time(),
                            "wait": wait}) + "\n")
  metrics.flush()
  return value


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  sidecar.jax.initialize()  # before any other JAX call; a no-op for a job of one process
  import jax
  import model

  config = model.CONFIGS[args.config]
  optimizer, train_step, replicated, rows = data_parallel(config)
  me = jax.process_index()
  say = (lambda line: print(line, flush=True)) if me == 0 else (lambda line: None)
  injected = trainers.Faults(args.inject_faults, say=lambda line: print(line, flush=True))
  target = model.abstract_state(config, optimizer, sharding=replicated)

  with sidecar.jax.Controller.from_env() as ctl:
    ckpt = ctl.checkpointer(os.path.abspath(args.ckpt), max_to_keep=args.keep)
    try:
      step = ckpt.latest_step()
      if step is None:
        step, data_state, how = 0, None, "initialised"
        state = model.init_state(config, optimizer, seed=args.seed, sharding=replicated)
      else:
        t0 = time.perf_counter()
        state = ckpt.restore(step, target=target)
        tier = getattr(ckpt.last_restore_stats(), "tier", "unknown")
        data_state = ckpt.data_state(step)
        how = f"restored step {step} ({tier} tier, {time.perf_counter() - t0:.2f} s)"
      say(f"pid {os.getpid()} {how}: {model.param_count(state['params']):,} parameters on "
          f"{jax.device_count()} device(s); {config.batch_size} images of "
          f"{config.image_size}x{config.image_size} a step; training to step {args.steps}")
      kwargs = {"data": os.path.abspath(args.data), "image_size": config.image_size}
      options = sidecar.FeedOptions(workers=args.workers, prefetch=args.prefetch,
                                    replay=args.replay)
      with (ctl.feed("vision", global_batch_size=config.batch_size, sharding=rows,
                     seed=args.seed, kwargs=kwargs, state=data_state, options=options) as feed,
            open(args.metrics if me == 0 else os.devnull, "a") as metrics):
        recovery = (sidecar.jax.Recovery(ckpt, feed, target=target)
                    if args.recover_in_process else None)
        progress = trainers.Progress(args.progress_every if me == 0 else 0, ckpt.latest_step)
        step = train(args, ckpt, feed, train_step, state, step, metrics=metrics,
                     progress=progress, recovery=recovery, injected=injected)
    finally:
      ckpt.close()  # waits for the last save to be durable
  say(f"trained to step {step}; checkpoints {ckpt.all_steps()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
