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
ready}``, with ``"first": true`` on the first step of each start and rollback, and
prints a progress line every ``--progress-every`` seconds. Saves every ``--save-every``
steps and after the last. With ``--recover-in-process``, a step that
raises rolls back to the latest committed step in the same process
(``sidecar.jax.Recovery``); the same step failing again ends the process. With
``--inject-faults`` (testing), ``trainers.INJECT``'s signals make a step raise or hang.
With ``--eval-every N``, every N steps it evaluates the model on held-out text
(``trainers.Evaluation``) inside ``ctl.phase("eval", budget_s=--eval-budget)``: the
evaluation is a phase it announces, so a watchdog (``sidecar launch --stall-timeout``)
never takes its steps' pause for a hang.

A checkpoint it cannot resume from ends it with the error and the flag that gets past
it: a damaged latest step names ``--restore-step N`` (an older step that checks intact)
and ``--fallback`` (the newest that restores whole); data that changed since the
checkpoint names ``--start-feed-anew`` (the restored model, the feed from its start on
the data given). Run the same command again with the flag. Training on from a step older
than the latest, it first sets the later steps aside (``ckpt.set_aside``: each moved,
whole, to ``<ckpt>/set-aside-<step>``, which no restore or retention takes for a step,
and said in a line), so that it saves their numbers anew; remove those directories once
you are done with them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, beside this file

import trainers  # noqa: E402

import sidecar  # noqa: E402

INTERRUPTED = 130  # the exit status of a run Ctrl-C stopped, as a shell's


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
  p.add_argument("--restore-step", type=int, metavar="N",
                 help="restore step N of --ckpt instead of the latest (one a refused restore "
                      "named as intact); training goes on from it, the later steps set "
                      "aside (<ckpt>/set-aside-<step>)")
  p.add_argument("--fallback", action="store_true",
                 help="where the latest step of --ckpt does not restore whole, restore the "
                      "newest older one that does (ckpt.restore(fallback=True)); the steps "
                      "it skipped are set aside (<ckpt>/set-aside-<step>)")
  p.add_argument("--eval-budget", type=float, default=900.0, metavar="SECONDS",
                 help="the longest an evaluation may take without a step before the "
                      "watchdog counts the trainer as stalled (its phase's budget)")
  p.add_argument("--eval-undeclared", action="store_true",
                 help="testing: evaluate without announcing the phase (as a trainer that "
                      "does not: sidecar launch finds it slow, its stall line says so)")
  p.add_argument("--hang-at", type=int, default=0, metavar="STEP",
                 help="testing: step STEP of the job's first start blocks in a call that "
                      "never returns (a hang that burns nothing); 0: never")
  p.add_argument("--recompile-at", default="", metavar="STEP:SECONDS[:PROCESS]",
                 help="testing: in step STEP of the job's first start, recompile programs "
                      "for SECONDS (a shape that changed: CPU-bound), in process PROCESS "
                      "only (default: every one)")
  p.add_argument("--start-feed-anew", action="store_true",
                 help="resume the model from --ckpt but start the feed from the beginning "
                      "of --data (its saved position is for data that changed since)")
  return trainers.parse(p, argv)


class Stalls:
  """``--hang-at`` and ``--recompile-at`` (testing), in the job's first start only: a step
  that blocks for good in a call (it burns nothing: a hang), or one that recompiles for a
  while (it burns the CPU: slow, not hung), as issue 77's tests need them."""

  def __init__(self, args: argparse.Namespace, me: int, *, say):
    first = os.environ.get("SIDECAR_RESTART", "0") == "0"
    self._hang = args.hang_at if first else 0
    at, seconds, who = (args.recompile_at.split(":") + ["", "", ""])[:3]
    self._recompile = (int(at), float(seconds)) if (
        args.recompile_at and first and (not who or int(who) == me)) else None
    self._say = say

  def check(self, step: int, config) -> None:
    if self._recompile is not None and step == self._recompile[0]:
      import jax
      import jax.numpy as jnp
      t0, n = time.monotonic(), 0
      while time.monotonic() - t0 < self._recompile[1]:  # a new program each time
        n += 1
        jax.jit(lambda x, n=n: jnp.tanh(x @ x.T + n).sum()).lower(
            jax.ShapeDtypeStruct((config.batch_size + n, config.d_model), jnp.float32)
        ).compile()
      self._say(f"recompiled {n} programs in step {step} ({time.monotonic() - t0:.2f} s)")
    if step == self._hang:
      self._say(f"hanging in step {step} (--hang-at) at unix {time.time():.6f}")
      threading.Event().wait()  # a call that never returns; SIGKILL ends it


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


def restore_or_init(ckpt, config, optimizer, sharding, args):
  """``(step, state, data_state, how)``: the checkpoint's (``--restore-step``, else the
  latest; ``--fallback``: the newest that restores whole), or a fresh state at step 0;
  ``how`` says which (with the restore's tier and seconds). ``--start-feed-anew``: no
  data state (the feed starts from the beginning)."""
  import model
  step = args.restore_step if args.restore_step is not None else ckpt.latest_step()
  if step is None:
    state = model.init_state(config, optimizer, seed=args.seed, sharding=sharding)
    return 0, state, None, "initialised"
  t0 = time.perf_counter()
  state = ckpt.restore(step, target=model.abstract_state(config, optimizer, sharding=sharding),
                       fallback=args.fallback)
  seconds = time.perf_counter() - t0
  step = ckpt.restored_step  # --fallback's may be older
  stats = ckpt.last_restore_stats()
  tier = stats.tier if stats is not None else "unknown"
  data_state = None if args.start_feed_anew else ckpt.data_state(step)
  how = f"restored step {step} ({tier} tier, {seconds:.2f} s)"
  return step, state, data_state, how + ("; the feed from its start" if data_state is None
                                         else "")


def set_aside_later(ckpt, step: int, say) -> None:
  """Training goes on from ``step``: the committed steps after it (a damaged step that
  ``--fallback`` skipped, or those ``--restore-step`` passed over) are set aside, each
  said, so that their numbers are saved anew (a save never replaces a committed step)."""
  for later in [s for s in ckpt.all_steps() if s > step]:
    where = ckpt.set_aside(later)
    say(f"set aside step {later} as {where} (newer than step {step}, which training goes on "
        f"from): its number is saved anew; remove that directory once you are done with it")


def flag_for(e: Exception) -> str | None:
  """What this command line can do about ``e`` (the library's error names the API):
  ``--restore-step``/``--fallback`` for a damaged step, ``--start-feed-anew`` for data
  that changed since the checkpoint; None for anything else."""
  if isinstance(e, sidecar.CorruptCheckpointError) and "fallback=True" in str(e):
    older = re.search(r"restore\((\d+), \.\.\.\)", str(e))
    step = older.group(1) if older else "N"
    return (f"From this command line: run it again with --restore-step {step} (that step), "
            "or with --fallback (the newest step that restores whole); either sets the "
            "steps after the one restored aside (<ckpt>/set-aside-<step>) and trains on, "
            "saving their numbers anew")
  if (isinstance(e, sidecar.PipelineInvalidArgumentError)
      and "the data changed since the checkpoint" in str(e)):
    return ("From this command line: run it again on the --data the checkpoint was made "
            "from, or with --start-feed-anew (the restored model, the feed from the start "
            "of this --data)")
  return None


def train(args, ckpt, feed, train_step, state, step: int, *, metrics, progress, recovery,
          fault: Fault, injected: trainers.Faults, evaluation: trainers.Evaluation,
          declare, stalls: Stalls, config) -> int:
  """Steps from ``step`` to ``args.steps``, saving every ``--save-every``; returns the last
  step. A step that raises goes to ``recovery`` (None: it ends the run)."""
  pending = None  # (step, loss, first): read once the next step is queued (the device busy)
  first = True  # the next step is the first of this start: its line says so (plot.py)
  progress.start(step)
  while step < args.steps:
    try:
      batch = next(feed)
      fault.check(step + 1)
      injected.check(step + 1)
      stalls.check(step + 1, config)
      state, loss = train_step(state, batch)
      if pending is not None:  # an asynchronous error of an earlier step surfaces here
        progress.step(pending[0], trainers.write_metric(metrics, *pending))
    except Exception as e:
      if recovery is None:
        raise
      state = batch = pending = None  # the failed state's memory, free for the restored one
      step, state = recovery.recover(e, step=step + 1)  # logs what failed and what it did
      progress.start(step)
      first = True
      continue
    step += 1
    pending, first = (step, loss, first), False
    if step % args.save_every == 0 or step == args.steps:
      ckpt.save(step, state, data_state=feed.state())
    evaluation.maybe(step, state, declare)
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

  ckpt = None
  try:
    with sidecar.jax.Controller.from_env() as ctl:
      ckpt = ctl.checkpointer(os.path.abspath(args.ckpt), max_to_keep=args.keep)
      try:
        step, state, data_state, how = restore_or_init(ckpt, config, optimizer, replicated,
                                                       args)
        set_aside_later(ckpt, step, say)
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
          # The evaluation is a phase the watchdog is told of (a pause of the steps, no hang).
          declare = (lambda name: contextlib.nullcontext()) if args.eval_undeclared else (
              lambda name: ctl.phase(name, budget_s=args.eval_budget))
          step = train(args, ckpt, feed, train_step, state, step, metrics=metrics,
                       progress=progress, recovery=recovery,
                       fault=Fault(args.fail_at, args.fail_times, say=me == 0),
                       injected=injected, evaluation=trainers.Evaluation(
                           args, config, rows, say=say), declare=declare,
                       stalls=Stalls(args, me, say=lambda line: print(line, flush=True)),
                       config=config)
      finally:
        ckpt.close()  # waits for the last save to be durable
  except KeyboardInterrupt:  # Ctrl-C: the checkpointer closed, its last save waited for
    latest = ckpt.latest_step() if ckpt is not None else None
    if me == 0:
      print(f"train.py: stopped (Ctrl-C); the latest committed step of {args.ckpt} is "
            + (f"{latest}: run the same command again to resume from it" if latest is not None
               else "none: the same command starts anew"), file=sys.stderr, flush=True)
    return INTERRUPTED
  say(f"trained to step {step}; checkpoints {ckpt.all_steps()}")
  return 0


def run(argv: list[str] | None = None) -> int:
  """:func:`main`, where an error this command line can fix ends it with that error and
  the flag (exit status 2), not a traceback. Ctrl-C ends it with one line naming the step
  to resume from (exit status 130, a shell's for SIGINT: :func:`main`)."""
  try:
    return main(argv)
  except (sidecar.CorruptCheckpointError, sidecar.PipelineInvalidArgumentError) as e:
    if (fix := flag_for(e)) is None:
      raise
    print(f"train.py: {type(e).__name__}: {e}\n{fix}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  sys.exit(run())
