"""Peer replicas of a 1 GiB step: staged -> replicated, and what it costs the training loop.

Run from the repository root: ``python -m benchmarks.replication``. Not run by CI.

The state is 8 x 128 MiB float32 jax.Arrays, each sharded over 2 hosts x 1 device of a
LocalCluster (512 MiB per host), saved with ``ctl.checkpointer(dir, replicas=R)``. In
one run, round by round:
  replicas=0            the baseline: the sidecars write their parts, nothing else
  replicas=1, shm       each sidecar copies its 512 MiB into the peer's arena, mapped
                        through the peer's worker socket (both on this machine)
  replicas=1, gRPC      the same bytes over authenticated gRPC on loopback: one
                        ``Checkpoint.Receive`` stream of raw 8 MiB parts
                        (``SIDECAR_REPLICA_SHM=0``: as between machines)
  replicas=1, shm, paced  as "shm", with ``replica_bandwidth="300MiB"`` per sidecar
Per save:
  staged -> replicated  from ``handle.staged`` to ``handle.replicated`` (R=1)
  staged -> durable     from ``handle.staged`` to ``handle.durable``
  steps/s               a jitted step (4 x 512x512 matmul + tanh) run on the trainer's
                        thread from ``staged`` until the later of replicated and durable,
                        against the same loop for 1.5 s just before, with no save in
                        flight; the replica and the write run at the same time, both on
                        ``SCHED_IDLE`` threads of the sidecars.
  trainer s lost        (1 - that ratio) x the window: the training time the save cost.
Checkpoints go to a temp dir under ``--dir`` and are removed afterwards. ``--only
grpc`` (or ``0``, ``shm``, ``paced``, comma-separated) runs only those configurations.
``--link`` measures the gRPC link alone instead: ``ReplicaLink.send`` of 512 MiB (8 x 64 MiB
shards) from this process to one sidecar, no trainer and no disk, as ``--link-part-mib`` parts.

``--pin`` runs every configuration with the trainer's threads on CPU 0 and the sidecars'
on the others: what a TPU or GPU host looks like, where the step runs on the accelerator
and the host's cores are free for the sidecar. Unpinned, the CPU backend's step wants every
core, so each byte the sidecars move takes CPU from the step itself (the worst case).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks import checkpoint as checkpoint_bench
from benchmarks.common import table
from sidecar._src.ckptfmt.records import ReplicaHeader, ReplicaTarget, ShardId
from sidecar._src.server.checkpoint import links as links_lib
from sidecar._src.server.checkpoint.checkpoints import SHM_ENV

LEAVES, LEAF_SHAPE = checkpoint_bench.LEAVES, checkpoint_bench.LEAF_SHAPE  # 1 GiB
progress = checkpoint_bench.progress
TARGET_REPLICATED_S, TARGET_STEPS = 2.0, 0.90
IDLE_S = 1.5


class Trainer(checkpoint_bench.Trainer):
  """The checkpoint benchmark's training step, with rates measured over a window."""

  def rate_until(self, done, *, at_least: int = 3) -> float:
    n, t0 = 0, time.perf_counter()
    while not done() or n < at_least:
      self()
      n += 1
    return n / (time.perf_counter() - t0)

  def idle_rate(self) -> float:
    deadline = time.perf_counter() + IDLE_S
    return self.rate_until(lambda: time.perf_counter() >= deadline)


def make_state(devices) -> dict[str, jax.Array]:
  sharding = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
  keys = jax.random.split(jax.random.key(0), LEAVES)
  return jax.block_until_ready(
      {f"layer{i}": jax.device_put(jax.random.normal(k, LEAF_SHAPE, jnp.float32), sharding)
       for i, k in enumerate(keys)})


def one_save(ckpt, step: int, state, train: Trainer, replicas: int) -> dict[str, float]:
  idle = train.idle_rate()
  at: dict[str, float] = {}
  handle = ckpt.save(step, state)
  for name in ("staged", "durable", "replicated"):
    getattr(handle, name).add_done_callback(
        lambda f, name=name: at.setdefault(name, time.perf_counter()))
  handle.staged.result()
  busy = train.rate_until(lambda: handle.durable.done() and handle.replicated.done())
  handle.durable.result()
  handle.replicated.result()
  window = max(at["durable"], at["replicated"]) - at["staged"]
  ckpt.wait()
  out = {"durable": at["durable"] - at["staged"], "steps": busy / idle,
         "lost": (1 - busy / idle) * window}
  if replicas:
    out["replicated"] = at["replicated"] - at["staged"]
  return out


def pin(pid: int, cpus: set[int]) -> None:
  """Every thread of process ``pid`` (and so every thread they start) onto ``cpus``."""
  for tid in os.listdir(f"/proc/{pid}/task"):
    with contextlib.suppress(ProcessLookupError):
      os.sched_setaffinity(int(tid), cpus)


def run_config(label: str, *, replicas: int, shm: bool, args, base: str,
               bandwidth: str | None = None) -> list[dict[str, float]]:
  env = {} if shm else {h: {SHM_ENV: "0"} for h in range(2)}
  progress(f"{label}: starting 2 sidecars")
  records = []
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size=args.shm_size,
                                    host_env=env) as cluster, cluster.controller() as ctl:
    if args.pin:
      for h in range(2):
        pin(cluster.pid(h), set(range(1, os.cpu_count() or 2)))
    state = make_state(cluster.devices(0) + cluster.devices(1))
    train = Trainer(cluster.devices(0)[0])
    train()
    directory = tempfile.mkdtemp(prefix="replication-", dir=base)
    with ctl.checkpointer(directory, replicas=replicas, ram_steps=1,
                          replica_bandwidth=bandwidth) as ckpt:
      for step in range(args.warmup + args.saves):
        r = one_save(ckpt, step, state, train, replicas)
        if step >= args.warmup:
          records.append(r)
          progress(f"{label}: save {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    shutil.rmtree(directory, ignore_errors=True)
  return records


def cell(values: list[float], fmt: str) -> str:
  if not values:
    return "-"
  return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})")


def link_only(args) -> None:
  """Seconds for ReplicaLink.send of 512 MiB to a sidecar over gRPC, ``args.saves`` times."""
  if args.link_part_mib:
    links_lib.PIECE_BYTES = args.link_part_mib << 20
  root = tempfile.mkdtemp(prefix="bench-link-", dir=args.dir)
  shards = [(ShardId(("w", i), ((0, 4096), (0, 4096))), np.full((4096, 4096), i, np.float32))
            for i in range(8)]
  header = ReplicaHeader(directory=root, step=1, final_dir=f"{root}/1/default", source=7)
  times = []
  try:
    with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="1536MiB",
                                      checkpoint_roots=(root,)) as cluster, \
        links_lib.ReplicaLink(ReplicaTarget(host_id=0, address=cluster.addresses[0]),
                              token=cluster.token, shared_memory=False,
                              replica_token=cluster._replica_token) as link:  # a sidecar's own
      for i in range(args.warmup + args.saves):
        t0 = time.perf_counter()
        link.send(header, shards)
        if i >= args.warmup:
          times.append(time.perf_counter() - t0)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f"ReplicaLink.send of 512 MiB over gRPC, parts of "
        f"{links_lib.PIECE_BYTES >> 20} MiB: {cell(times, '.3f')} s "
        f"({(512 << 20) / statistics.median(times) / 1e9:.2f} GB/s)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--saves", type=int, default=4, help="measured saves per configuration")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--shm-size", default="2304MiB",
                      help="each sidecar's arena: a step's part and a replica, twice")
  parser.add_argument("--dir", default=None, help="where checkpoints go (not a tmpfs)")
  parser.add_argument("--pin", action="store_true",
                      help="the trainer on CPU 0, the sidecars on the other CPUs")
  parser.add_argument("--only", default=None,
                      help="comma-separated configurations to run, of 0, shm, grpc, paced")
  parser.add_argument("--link", action="store_true", help="measure ReplicaLink.send alone")
  parser.add_argument("--link-part-mib", type=int, default=0,
                      help="with --link: parts of this many MiB (default: PIECE_BYTES)")
  args = parser.parse_args()
  if args.pin:
    pin(os.getpid(), {0})  # before JAX makes its thread pools: they inherit it
  if args.link:
    link_only(args)
    return
  base = tempfile.mkdtemp(prefix="bench-replication-", dir=args.dir)
  configs = [("replicas=0", 0, True, None), ("replicas=1, shm", 1, True, None),
             ("replicas=1, gRPC", 1, False, None),
             ("replicas=1, shm, paced", 1, True, "300MiB")]
  if args.only is not None:
    keys = ["0", "shm", "grpc", "paced"]
    wanted = args.only.split(",")
    if not set(wanted) <= set(keys):
      parser.error(f"--only takes some of {','.join(keys)}, got {args.only!r}")
    configs = [c for k, c in zip(keys, configs) if k in wanted]
  results = {}
  with contextlib.ExitStack() as stack:
    stack.callback(shutil.rmtree, base, ignore_errors=True)
    for label, replicas, shm, bandwidth in configs:
      results[label] = run_config(label, replicas=replicas, shm=shm, args=args,
                                  base=base, bandwidth=bandwidth)
  rows = []
  for label, *_ in configs:
    rs = results[label]
    rows.append([label, cell([r["replicated"] for r in rs if "replicated" in r], ".2f"),
                 cell([r["durable"] for r in rs], ".2f"),
                 cell([100 * r["steps"] for r in rs], ".0f"),
                 cell([r["lost"] for r in rs], ".2f")])
  where = ("trainer on CPU 0, sidecars on the others" if args.pin
           else "trainer and sidecars share every CPU")
  print(f"\n1 GiB step (8 x 128 MiB float32 over 2 hosts x 1 device), {args.saves} saves each "
        f"(median (min-max)); {where}:\n")
  print(table(["saver", "staged -> replicated s", "staged -> durable s",
               "steps/s while saving, % of idle", "trainer s lost"], rows))
  for label in [c[0] for c in configs if c[1]]:
    rep = statistics.median(r["replicated"] for r in results[label])
    steps = statistics.median(r["steps"] for r in results[label])
    print(f"{label}: staged -> replicated {rep:.2f} s (target <= {TARGET_REPLICATED_S:g} s): "
          f"{'met' if rep <= TARGET_REPLICATED_S else 'NOT met'}; steps/s while replicating "
          f"{steps:.0%} of idle (target >= {TARGET_STEPS:.0%}): "
          f"{'met' if steps >= TARGET_STEPS else 'NOT met'}")


if __name__ == "__main__":
  main()
