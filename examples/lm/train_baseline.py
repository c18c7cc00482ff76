"""The LM of model.py trained as users do today: Grain in-process, Orbax's CheckpointManager.

The baseline of ``benchmarks.goodput``: the same model, data, order and command line as
``train.py``, without sidecars. From the repository root::

  python examples/lm/train_baseline.py --config tiny --data /tmp/lm-data \\
      --ckpt /tmp/lm-ckpt-orbax --steps 300 --save-every 100 --metrics /tmp/lm-orbax.jsonl

(``benchmarks.goodput`` runs it under ``sidecar launch --max-restarts``, as it runs
``train.py``, so that both are restarted the same way; nothing here talks to a sidecar.)

The data: ``pipelines.lm.Sequences`` read in this process by Grain, in the order a sidecar
feed gives them (``sidecar/_src/server/feeds/producer.py``): per epoch one permutation of
all sequences from ``numpy.random.default_rng(epoch_seed(seed, epoch))``, cut into batches
of ``batch_size`` that never straddle an epoch. The checkpoint: Orbax's async
CheckpointManager saving, in one step, the state (``StandardSave``) and Grain's iterator
state (``grain.checkpoint.CheckpointSave``, Orbax's Grain handler). At start the latest
step is restored, both items. Step numbering and metrics lines are train.py's: step n is
the n-th update, ``{"step": n, "loss": x, "time": unix seconds}`` per step; so is
``--inject-faults`` (an injected error is not caught here: the process ends).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import pathlib
import sys
import time

# model.py beside this file; pipelines/ at the repository root.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[2]))

import trainers  # noqa: E402

EPOCHS = 100_000  # the iterator's length in epochs: in effect, forever


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = trainers.parser(__doc__.split("\n\n")[0], ckpt_help="Orbax checkpoint directory")
  p.add_argument("--read-threads", type=int, default=4,
                 help="Grain's prefetch threads in this process")
  return trainers.parse(p, argv)


def epoch_seed(seed: int, epoch: int) -> int:
  """The shuffle seed of one epoch, as a sidecar feed derives it (``producer.epoch_seed``)."""
  digest = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


class EpochOrder:
  """Row ``i`` of the stream -> the sequence a sidecar feed puts there (thread-safe)."""

  def __init__(self, count: int, batch_size: int, seed: int):
    self.count, self.seed = count, seed
    self.per_epoch = count // batch_size * batch_size  # an epoch's last partial batch dropped

  @functools.lru_cache(maxsize=2)  # noqa: B019 - one instance per process, two epochs live
  def permutation(self, epoch: int):
    import numpy as np
    return np.random.default_rng(epoch_seed(self.seed, epoch)).permutation(
        self.count).astype(np.uint32)

  def __call__(self, i: int) -> int:
    epoch, position = divmod(int(i), self.per_epoch)
    return int(self.permutation(epoch)[position])


def make_iterator(data: str, *, seq_len: int, batch_size: int, seed: int, threads: int):
  """Grain's iterator of ``{"tokens": int32[batch_size, seq_len + 1]}`` batches, in order."""
  import grain

  from pipelines import lm

  sequences = lm.Sequences(data, seq_len)
  order = EpochOrder(len(sequences), batch_size, seed)
  rows = grain.MapDataset.range(order.per_epoch * EPOCHS).map(lambda i: sequences[order(i)])
  batches = rows.batch(batch_size, drop_remainder=True)
  options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * max(1, threads))
  return iter(batches.to_iter_dataset(options))


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  import grain
  import jax
  import model
  import orbax.checkpoint as ocp

  config = model.CONFIGS[args.config]
  optimizer, train_step, replicated, rows = trainers.data_parallel(config)
  iterator = make_iterator(os.path.abspath(args.data), seq_len=config.seq_len,
                           batch_size=config.batch_size, seed=args.seed,
                           threads=args.read_threads)
  options = ocp.CheckpointManagerOptions(max_to_keep=args.keep,
                                         enable_async_checkpointing=True)
  with ocp.CheckpointManager(os.path.abspath(args.ckpt), options=options) as manager:
    step = manager.latest_step()
    if step is None:
      step, how = 0, "initialised"
      state = model.init_state(config, optimizer, seed=args.seed, sharding=replicated)
    else:
      t0 = time.perf_counter()
      target = model.abstract_state(config, optimizer, sharding=replicated)
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target),
          data=grain.checkpoint.CheckpointRestore(iterator)))
      state, iterator = restored["state"], restored["data"]
      how = f"restored step {step} (storage tier, {time.perf_counter() - t0:.2f} s)"
    print(f"{how}: {model.param_count(state['params']):,} parameters on "
          f"{jax.device_count()} device(s); training to step {args.steps}", flush=True)
    progress = trainers.Progress(args.progress_every, manager.latest_step)
    progress.start(step)
    injected = trainers.Faults(args.inject_faults, say=lambda line: print(line, flush=True))
    with open(args.metrics, "a") as metrics:
      pending = None  # (step, loss, first): read once the next step is queued, as train.py
      first = True  # does; the first step of this start says so (plot.py)
      while step < args.steps:
        batch = jax.device_put(next(iterator), rows)
        injected.check(step + 1)  # an error ends the process: its launcher restarts it
        state, loss = train_step(state, batch)
        step += 1
        if pending is not None:
          progress.step(pending[0], trainers.write_metric(metrics, *pending))
        pending, first = (step, loss, first), False
        if step % args.save_every == 0 or step == args.steps:
          # The iterator has yielded exactly the batches of steps 1..step: its state now
          # resumes at step + 1 (Grain's handler reads it inside save()).
          manager.save(step, args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              data=grain.checkpoint.CheckpointSave(iterator)))
      if pending is not None:
        trainers.write_metric(metrics, *pending)
    manager.wait_until_finished()
    print(f"trained to step {step}; checkpoints {list(manager.all_steps())}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
