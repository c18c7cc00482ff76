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
ready}``, and prints a progress line every ``--progress-every`` seconds. Saves every
``--save-every`` steps and after the last. With ``--recover-in-process``, a step that
raises rolls back to the latest committed step in the same process
(``sidecar.jax.Recovery``); the same step failing again ends the process. With
``--inject-faults`` (testing), ``trainers.INJECT``'s signals make a step raise or hang.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, beside this file

import trainers  # noqa: E402

import sidecar  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = trainers.parser(__doc__.split("\n\n")[0],
                      ckpt_help="checkpoint directory, under the sidecars' --checkpoint-root")
  p.add_argument("--recover-in-process", action="store_true",
                 help="a step that raises rolls back to the latest committed step in this "
                      "process (sidecar.jax.Recovery); the same step failing twice ends it")
  p.add_argument("--fail-at", type=int, default=0, metavar="STEP",
                 help="testing: raise in step STEP (after its batch is taken), in the job's "
                      "first start only (SIDECAR_RESTART 0); 0: never")
  p.add_argument("--fail-times", type=int, default=1, metavar="N",
                 help="testing: how often --fail-at's step raises in this process")
  return trainers.parse(p, argv)


class Fault:
  """``--fail-at``: raises in one step, ``times`` times, in the job's first start only (a
  trainer restarted by ``sidecar launch --max-restarts`` runs clean)."""

  def __init__(self, step: int, times: int, *, say: bool):
    first_start = os.environ.get("SIDECAR_RESTART", "0") == "0"
    self.step, self.left, self._say = step, times if step > 0 and first_start else 0, say

  def check(self, step: int) -> None:
    if step != self.step or self.left <= 0:
      return
    self.left -= 1
    if self._say:
      print(f"fault: raising in step {step} (--fail-at) at unix {time.time():.6f}", flush=True)
    raise RuntimeError(f"injected failure in step {step} (--fail-at {self.step})")


def restore_or_init(ckpt, config, optimizer, sharding, seed: int):
  """``(step, state, data_state, how)``: the latest checkpoint's, or a fresh state at step 0;
  ``how`` says which (with the restore's tier and seconds)."""
  import model
  step = ckpt.latest_step()
  if step is None:
    state = model.init_state(config, optimizer, seed=seed, sharding=sharding)
    return 0, state, None, "initialised"
  t0 = time.perf_counter()
  state = ckpt.restore(step, target=model.abstract_state(config, optimizer, sharding=sharding))
  seconds = time.perf_counter() - t0
  stats = ckpt.last_restore_stats()
  tier = stats.tier if stats is not None else "unknown"
  return step, state, ckpt.data_state(step), f"restored step {step} ({tier} tier, {seconds:.2f} s)"


def train(args, ckpt, feed, train_step, state, step: int, *, metrics, progress, recovery,
          fault: Fault, injected: trainers.Faults) -> int:
  """Steps from ``step`` to ``args.steps``, saving every ``--save-every``; returns the last
  step. A step that raises goes to ``recovery`` (None: it ends the run)."""
  pending = None  # (step, loss): read once the next step is queued, so the device is busy
  progress.start(step)
  while step < args.steps:
    try:
      batch = next(feed)
      fault.check(step + 1)
      injected.check(step + 1)
      state, loss = train_step(state, batch)
      if pending is not None:  # an asynchronous error of an earlier step surfaces here
        progress.step(pending[0], trainers.write_metric(metrics, *pending))
    except Exception as e:
      if recovery is None:
        raise
      state = batch = pending = None  # the failed state's memory, free for the restored one
      step, state = recovery.recover(e, step=step + 1)  # logs what failed and what it did
      progress.start(step)
      continue
    step += 1
    pending = (step, loss)
    if step % args.save_every == 0 or step == args.steps:
      ckpt.save(step, state, data_state=feed.state())
  if pending is not None:
    progress.step(pending[0], trainers.write_metric(metrics, *pending))
  return step


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  sidecar.jax.initialize()  # before any other JAX call; a no-op for a job of one process
  import jax
  import model

  config = model.CONFIGS[args.config]
  optimizer, train_step, replicated, rows = trainers.data_parallel(config)
  me = jax.process_index()
  say = (lambda line: print(line, flush=True)) if me == 0 else (lambda line: None)
  injected = trainers.Faults(args.inject_faults, say=lambda line: print(line, flush=True))

  with sidecar.jax.Controller.from_env() as ctl:
    ckpt = ctl.checkpointer(os.path.abspath(args.ckpt), max_to_keep=args.keep)
    try:
      step, state, data_state, how = restore_or_init(ckpt, config, optimizer, replicated,
                                                     args.seed)
      say(f"pid {os.getpid()} {how}: {model.param_count(state['params']):,} parameters on "
          f"{jax.device_count()} device(s) in {jax.process_count()} process(es); training "
          f"to step {args.steps}")
      kwargs = {"data": os.path.abspath(args.data), "seq_len": config.seq_len}
      with (ctl.feed("lm", global_batch_size=config.batch_size, sharding=rows, seed=args.seed,
                     kwargs=kwargs, state=data_state) as feed,
            open(args.metrics if me == 0 else os.devnull, "a") as metrics):
        recovery = sidecar.jax.Recovery(
            ckpt, feed, target=model.abstract_state(config, optimizer, sharding=replicated)
        ) if args.recover_in_process else None
        progress = trainers.Progress(args.progress_every if me == 0 else 0, ckpt.latest_step)
        step = train(args, ckpt, feed, train_step, state, step, metrics=metrics,
                     progress=progress, recovery=recovery,
                     fault=Fault(args.fail_at, args.fail_times, say=me == 0),
                     injected=injected)
    finally:
      ckpt.close()  # waits for the last save to be durable
  say(f"trained to step {step}; checkpoints {ckpt.all_steps()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
