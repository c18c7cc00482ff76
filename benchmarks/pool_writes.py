"""A shared pool's write bandwidth (issue 37): tenants saving at once on one sidecar.

Run from the repository root: ``python -m benchmarks.pool_writes``. Not run by CI.

One ``LocalCluster(pool=...)`` of four tenants (an arena of 32 saves, a fifth guaranteed
each: the hog's saves and their RAM-tier copies fit in its share and the free fifth).
Each tenant is its own trainer process (its token in ``SIDECAR_TOKEN``, attached to the
arena) that saves a ``--state-mib`` MiB state in a loop for ``--seconds`` (each save waited
for until durable, then the next): one checkpoint directory at a time, or, for the
misbehaving tenant t3, HOG_DIRS directories at once (HOG_DIRS saves always in flight).
Reported: each tenant's durable MB/s; first three equal tenants (each one's fair share of
the storage), then t0 and t1 beside the hog, set against their fair share. The target is
>= 0.80. ``--repeat`` runs each configuration again, for the spread.

Each file a save writes takes one of its tenant's turns at the storage
(``server/shares.py``: ``WRITE_TURNS`` at once on a sidecar, shared by weight among the
tenants writing), so the hog's four saves share one tenant's turns. To measure the
sidecar before that change, run this file against an older checkout (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import tempfile
import time

import numpy as np

import sidecar
from benchmarks.common import table
from benchmarks.pool import gather, token, write_pool

TENANTS = ("t0", "t1", "t2", "t3")
STATE_MIB = 128
HOG_DIRS = 4
POOL = "tenants:\n" + "".join(
    f"  - {{name: {t}, token_file: {t}.token, arena: 0.2, checkpoint_roots: [{t}]}}\n"
    for t in TENANTS)


def saver(name: str, addresses: list[str], directory: str, dirs: int, mib: int,
          start_at: float, seconds: float, out: multiprocessing.Queue) -> None:
  """One tenant's trainer: saves ``mib`` MiB in ``dirs`` directories at once from
  ``start_at`` for ``seconds``; puts (name, durable bytes per second)."""
  os.environ["SIDECAR_TOKEN"] = token(name)
  state = {"w": np.ones((mib << 20) // 4, np.float32)}
  with sidecar.jax.Controller(addresses, timeout=120) as ctl, contextlib.ExitStack() as stack:
    cks = [stack.enter_context(ctl.checkpointer(
        os.path.join(directory, name, f"ck-{start_at:.0f}-{i}"), max_to_keep=1))
        for i in range(dirs)]
    for ck in cks:  # warm: the first save of each directory
      ck.save(0, state).durable.result(120)
    time.sleep(max(0.0, start_at - time.time()))
    step, written = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
      step += 1
      handles = [ck.save(step, state) for ck in cks]
      for h in handles:
        h.durable.result(120)
      written += dirs * (mib << 20)
    out.put((name, written / (time.perf_counter() - t0)))


def run(cluster, directory: str, savers: dict[str, int], mib: int, seconds: float
        ) -> dict[str, float]:
  """``savers`` (tenant: directories at once) saving at once; each one's bytes/s."""
  ctx = multiprocessing.get_context("spawn")
  out = ctx.Queue()
  start_at = time.time() + 25.0  # after every trainer imported and warmed
  procs = [ctx.Process(target=saver, args=(name, list(cluster.addresses), directory, dirs,
                                           mib, start_at, seconds, out))
           for name, dirs in savers.items()]
  got = gather(procs, out, timeout=seconds + 240)
  return dict(got)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seconds", type=float, default=10.0, help="each run's measured seconds")
  ap.add_argument("--repeat", type=int, default=2, help="runs of each configuration")
  ap.add_argument("--state-mib", type=int, default=STATE_MIB, help="MiB a save writes")
  args = ap.parse_args()
  well = TENANTS[:2]
  with contextlib.ExitStack() as stack:
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="sidecar-pool-writes-"))
    cluster = stack.enter_context(sidecar.testing.LocalCluster(
        1, 1, shm_size=f"{args.state_mib * 32}MiB", pool=write_pool(directory, POOL, TENANTS),
        configure_jax=False,
        checkpoint_roots=[directory]))
    fair: dict[str, list[float]] = {t: [] for t in well}
    hog: dict[str, list[float]] = {t: [] for t in well + ("t3",)}
    for _ in range(args.repeat):  # interleaved: the machine's load moves both alike
      equal = run(cluster, directory, {t: 1 for t in TENANTS[:3]}, args.state_mib, args.seconds)
      print("three equal:", {t: f"{r / 1e6:.0f} MB/s" for t, r in equal.items()}, flush=True)
      for t in well:
        fair[t].append(equal[t])
      beside = run(cluster, directory, {"t0": 1, "t1": 1, "t3": HOG_DIRS}, args.state_mib,
                   args.seconds)
      print("beside the hog:", {t: f"{r / 1e6:.0f} MB/s" for t, r in beside.items()},
            flush=True)
      for t in hog:
        hog[t].append(beside[t])
  rows = []
  for t in well:
    ratios = [b / f for b, f in zip(hog[t], fair[t])]
    rows.append([t, " / ".join(f"{r / 1e6:.0f}" for r in fair[t]),
                 " / ".join(f"{r / 1e6:.0f}" for r in hog[t]),
                 " / ".join(f"{x:.2f}" for x in ratios), "yes" if min(ratios) >= 0.8 else "NO"])
  rows.append(["t3 (the hog)", "-", " / ".join(f"{r / 1e6:.0f}" for r in hog["t3"]), "-", ""])
  print(f"\n## {args.state_mib} MiB saves in a loop, {args.repeat} runs of {args.seconds:g} s; t3 "
        f"saves in {HOG_DIRS} directories at once\n")
  print(table(["tenant", "MB/s among 3 equal (fair share)", f"MB/s beside t3's {HOG_DIRS} saves",
               "vs fair share", ">= 0.80"], rows))


if __name__ == "__main__":
  main()
