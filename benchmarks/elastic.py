"""Recovery from a lost host: single-controller ``sidecar.elastic.retry`` on 3 hosts.

Run from the repository root: ``python -m benchmarks.elastic``. Not run by CI.

A LocalCluster of 3 hosts x 2 CPU devices trains a 1 GiB state (8 x 128 MiB float32,
rows sharded over the mesh) fed by ``ctl.feed``; it saves every few steps. Mid-way the
benchmark SIGKILLs host 2's sidecar and measures, from that kill, each phase until the
first training step completes on the 2 hosts left:

  detect        the kill -> the controller's health watch declares the host lost
  cancel        -> the training function's failure reaches ``retry`` (feeds closed)
  restore       ``ckpt.restore`` of the latest step onto the new mesh (resharded)
  reopen feed   ``ctl.feed(..., state=...)`` and its first batch
  first step    the jitted step on the new mesh: its recompile and run
  total         the kill -> the first step done on the survivors

Three recoveries in one run, each restoring the same step: from host memory only (each
host's shards also live in the next host's arena, ``replicas=1``: the lost host's come
from a survivor's replica), from the survivors' RAM tiers with the lost host's shards
from storage (``replicas=0``), and from storage only (``ram_steps=0``). Each run checks
the state after recovery equals an uninterrupted run's (integer-valued data).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar import elastic

HOSTS, DEVICES, BATCH = 3, 2, 12
LEAVES, ROWS, COLS = 8, 768, 43_690  # 8 x 128 MiB float32; rows divide 6 and 4 devices


@jax.jit
def step_fn(state, batch):
  bump = jnp.sum(batch["id"]).astype(jnp.float32)
  return [w + bump for w in state]


def run(directory: str, *, ram_steps: int, replicas: int, kill_at: int | None, steps: int,
        save_every: int) -> dict:
  """One training run; returns the phases of its recovery and its final state."""
  marks: dict[str, float] = {}
  with sidecar.testing.LocalCluster(HOSTS, DEVICES, shm_size="1536MiB",
                                    imports=["tests.support.feed_fns"]) as cluster:
    with cluster.controller() as ctl:

      @elastic.retry(ctl, min_hosts=2)
      def train(hosts):
        mesh = Mesh(np.array(elastic.devices(ctl, hosts)), ("data",))
        rows = NamedSharding(mesh, P("data"))
        ckpt = ctl.checkpointer(directory, max_to_keep=2, ram_steps=ram_steps,
                                replicas=replicas)
        start = ckpt.latest_step()
        restart = "killed" in marks
        if start is None:
          state = [jax.device_put(jnp.zeros((ROWS, COLS), jnp.float32), rows)
                   for _ in range(LEAVES)]
          data, start = None, 0
        else:
          t = time.monotonic()
          state = ckpt.restore(target=[jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32,
                                                            sharding=rows)] * LEAVES)
          jax.block_until_ready(state)
          data = ckpt.data_state()
          marks["restored"], marks["restore_s"] = time.monotonic(), time.monotonic() - t
          marks["sources"] = ckpt.last_restore_stats().shards
        t = time.monotonic()
        with ctl.feed("ids", kwargs={"n": 6000}, global_batch_size=BATCH, sharding=rows, seed=3,
                      state=data, options=sidecar.FeedOptions(prefetch=2)) as feed:
          batch = next(feed)
          if restart:
            marks["feed_s"] = time.monotonic() - t
          for step in range(start + 1, steps + 1):
            if kill_at == step and "killed" not in marks:
              marks["killed"] = time.monotonic()
              cluster.kill(2)
            t = time.monotonic()
            state = step_fn(state, batch)
            jax.block_until_ready(state)
            if restart and "first_step_s" not in marks:
              marks["first_step_s"] = time.monotonic() - t
              marks["first_step_done"] = time.monotonic()
            if step % save_every == 0:
              ckpt.save(step, state, data_state=feed.state())
              ckpt.wait()
            if step < steps:
              batch = next(feed)
        ckpt.close()
        return [float(np.asarray(w)[0, 0]) for w in state], start

      final, restored_step = train()
      events = train.events
  out = {"final": final, "restored_step": restored_step, "events": events, **marks}
  if "killed" in marks:
    lost = next(e for e in events if e.kind == "host_lost")
    retry = next(e for e in events if e.kind == "retry")
    out["detect_s"] = lost.at - marks["killed"]
    out["cancel_s"] = retry.at - lost.at
    out["total_s"] = marks["first_step_done"] - marks["killed"]
  return out


def _child(directory: str, ram_steps: int, replicas: int, kill_at: int | None) -> dict:
  """One run in a fresh process (a long-lived process keeps earlier runs' arenas mapped
  for a while), its figures as JSON on the last line of its output."""
  command = [sys.executable, "-m", "benchmarks.elastic", "--child", directory, str(ram_steps),
             str(replicas), str(kill_at or 0)]
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
  if done.returncode:
    raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dir", default=tempfile.gettempdir())
  parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
  args = parser.parse_args()
  steps, save_every, kill_at = 8, 3, 5
  if args.child:
    directory, ram_steps, replicas, kill = args.child
    out = run(directory, ram_steps=int(ram_steps), replicas=int(replicas),
              kill_at=int(kill) or None, steps=steps, save_every=save_every)
    out["events"] = [dataclasses.asdict(e) for e in out["events"]]
    print(json.dumps(out))
    return 0
  root = tempfile.mkdtemp(prefix="sidecar-bench-elastic-", dir=args.dir)
  variants = {"host memory: RAM tiers + peer replicas": (1, 1),
              "RAM tiers, the lost host's shards from storage": (1, 0),
              "storage only": (0, 0)}
  rows: dict[str, list[dict]] = {name: [] for name in variants}
  try:
    want = _child(f"{root}/whole", 1, 0, None)["final"]
    for r in range(args.rounds):
      for i, (name, (ram_steps, replicas)) in enumerate(variants.items()):
        got = _child(f"{root}/{r}-{i}", ram_steps, replicas, kill_at)
        got["exact"] = got["final"] == want
        rows[name].append(got)
        print(f"round {r} {name}: total {got['total_s']:.2f} s, exact {got['exact']}, "
              f"shards from {got['sources']}", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  phases = ("detect_s", "cancel_s", "restore_s", "feed_s", "first_step_s", "total_s")
  print("\n| recovery (3 hosts -> 2, 1 GiB state) | " + " | ".join(
      p[:-2].replace("_", " ") + " s" for p in phases) + " | bit-exact |")
  print("|---" * (len(phases) + 2) + "|")
  for name, runs in rows.items():
    cells = [f"{statistics.median(r[p] for r in runs):.3f}" for p in phases]
    exact = f"{sum(r['exact'] for r in runs)}/{len(runs)}"
    print(f"| {name} | " + " | ".join(cells) + f" | {exact} |")
  memory, _, disk = (statistics.median(r["total_s"] for r in rows[n]) for n in rows)
  print(f"\nrecovery from host memory: {memory:.2f} s (target <= 5 s); from storage "
        f"{disk:.2f} s: storage / memory {disk / memory:.2f}x (medians of {args.rounds} rounds)")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
