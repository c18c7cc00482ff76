"""A shared pool of sidecars (issue 37): N tenants at once on one local pool.

Run from the repository root: ``python -m benchmarks.pool``. Not run by CI.

One ``LocalCluster(pool=...)`` of four tenants, each with a guaranteed quarter of the
arena less a margin. For N = 1, 2, 4 tenants at once, each tenant is its own trainer
process (its token in ``SIDECAR_TOKEN``, attached to the arena) that feeds batches of
1 MiB and saves a 4 MiB state every SAVE_EVERY batches for ``--seconds``; reported: each
tenant's batches/s and saves/s, its rate against running alone (N = 1), and Jain's
fairness index of the rates, (sum x)^2 / (N sum x^2), 1.0 when equal. Then: how long a
new tenant takes to join (a Controller and its first call) while another floods
handshakes, and the sidecar's peak RSS growth for one 128 MiB inline call (size_of: the
argument in; echo: in and back), as a ratio of the payload.

The machine's cores are shared too: on 2 cores, four trainers and their feeds compete
for CPU as much as for the pool, so "vs alone" there includes the machine's share.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import tempfile
import time

import grpc
import numpy as np

import sidecar
from benchmarks.attacks import _proc, _reset_peak
from benchmarks.common import table
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

TENANTS = ("t0", "t1", "t2", "t3")
BATCH = 64  # rows of 16 KiB: 1 MiB a batch
SAVE_EVERY = 50
STATE_BYTES = 4 << 20
FLOOD_SESSIONS = 8  # the flooding tenant's session quota
POOL = f"""\
tenants:
  - {{name: t0, token_file: t0.token, arena: 0.2, checkpoint_roots: [t0]}}
  - {{name: t1, token_file: t1.token, arena: 0.2, checkpoint_roots: [t1]}}
  - {{name: t2, token_file: t2.token, arena: 0.2, checkpoint_roots: [t2]}}
  - {{name: t3, token_file: t3.token, arena: 0.2, checkpoint_roots: [t3], sessions: {FLOOD_SESSIONS}}}
"""


def token(name: str) -> str:
  return f"benchmark-token-of-{name}"


def write_pool(directory: str) -> str:
  for name in TENANTS:
    path = os.path.join(directory, f"{name}.token")
    with open(path, "w") as f:
      f.write(token(name))
    os.chmod(path, 0o600)
    os.makedirs(os.path.join(directory, name), exist_ok=True)
  path = os.path.join(directory, "pool.yaml")
  with open(path, "w") as f:
    f.write(POOL)
  os.chmod(path, 0o600)
  return path


def tenant(name: str, addresses: list[str], directory: str, start_at: float, seconds: float,
           out: multiprocessing.Queue) -> None:
  """One tenant's trainer: feeds and saves from ``start_at`` for ``seconds``."""
  os.environ["SIDECAR_TOKEN"] = token(name)
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  state = {"w": np.ones(STATE_BYTES // 4, np.float32)}
  with sidecar.Controller(addresses, timeout=120) as ctl, \
      ctl.feed("rows", global_batch_size=BATCH, sharding=sharding) as feed, \
      ctl.checkpointer(os.path.join(directory, name, "ck"), max_to_keep=2) as ckpt:
    jax.block_until_ready(next(feed))  # warm: the feed's workers run
    time.sleep(max(0.0, start_at - time.time()))
    batches = saves = 0
    handle = None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
      jax.block_until_ready(next(feed))
      batches += 1
      if batches % SAVE_EVERY == 0:
        if handle is not None:
          handle.durable.result(120)
          saves += 1
        handle = ckpt.save(batches, state)
    elapsed = time.perf_counter() - t0
    if handle is not None:
      handle.durable.result(120)
      saves += 1
  out.put((name, batches / elapsed, saves / elapsed))


def run_tenants(cluster, directory: str, n: int, seconds: float) -> dict[str, tuple]:
  """Tenants ``TENANTS[:n]`` at once; each one's (batches/s, saves/s)."""
  ctx = multiprocessing.get_context("spawn")
  out = ctx.Queue()
  start_at = time.time() + 25.0  # after every trainer imported JAX and warmed its feed
  procs = [ctx.Process(target=tenant, args=(name, list(cluster.addresses), directory,
                                            start_at, seconds, out))
           for name in TENANTS[:n]]
  for p in procs:
    p.start()
  try:
    results = dict((name, (rate, saves)) for name, rate, saves in
                   (out.get(timeout=seconds + 240) for _ in procs))
  finally:
    for p in procs:
      p.join(30)
      if p.is_alive():
        p.kill()
        p.join()
  return results


def jain(rates: list[float]) -> float:
  return sum(rates) ** 2 / (len(rates) * sum(r * r for r in rates)) if rates else 0.0


def flood(address: str, seconds: float, refused: multiprocessing.Value) -> None:
  """Tenant t3's handshakes, as fast as one process sends them, for ``seconds``."""
  end = time.monotonic() + seconds
  with grpc.insecure_channel(address) as channel:
    handshake = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                                    request_serializer=pb.HandshakeRequest.SerializeToString)
    while time.monotonic() < end:
      try:
        handshake(pb.HandshakeRequest(versions=protocol.local_versions()), timeout=10,
                  metadata=[(protocol.AUTH_KEY, f"Bearer {token('t3')}")])
      except grpc.RpcError:
        with refused.get_lock():
          refused.value += 1


def join_during_flood(cluster, joins: int = 5) -> tuple[list[float], int]:
  """Seconds for tenant t0 to join (a Controller, its handshake and a call), ``joins``
  times, while t3 floods handshakes from another process; and how many of t3's were
  refused meanwhile."""
  ctx = multiprocessing.get_context("spawn")
  refused = ctx.Value("l", 0)
  flooder = ctx.Process(target=flood, args=(cluster.addresses[0], 20.0 + 3 * joins, refused))
  flooder.start()
  took = []
  try:
    while not refused.value:  # past its quota: every handshake of t3 is refused now
      time.sleep(0.1)
    time.sleep(2.0)  # the flood in full swing
    for _ in range(joins):
      t0 = time.perf_counter()
      with sidecar.Controller(cluster.addresses, token=token("t0"), attach=False,
                              timeout=30) as ctl:
        ctl.call("size_of", args=(np.zeros(4, np.uint8),))
        took.append(time.perf_counter() - t0)
  finally:
    flooder.kill()
    flooder.join()
  return sorted(took), refused.value


def inline_growth(cluster, fn: str, mib: int = 128) -> float:
  """The sidecar's peak RSS growth for one ``fn`` call with a ``mib`` MiB array inline, as a
  ratio of the array's size."""
  with sidecar.Controller(cluster.addresses, token=token("t1"), attach=False,
                          timeout=120) as ctl:
    ctl.call(fn, args=(np.ones(1 << 20, np.uint8),))  # warm
    big = np.ones(mib << 20, np.uint8)
    time.sleep(0.5)
    _reset_peak(cluster.pid(0))
    before, _ = _proc(cluster.pid(0))
    ctl.call(fn, args=(big,))
    after, _ = _proc(cluster.pid(0))
  return (after - before) / mib


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seconds", type=float, default=10.0, help="each run's measured seconds")
  ap.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4])
  args = ap.parse_args()
  with contextlib.ExitStack() as stack:
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="sidecar-pool-"))
    cluster = stack.enter_context(sidecar.testing.LocalCluster(
        1, 1, shm_size="256MiB", pool=write_pool(directory), configure_jax=False,
        imports=["benchmarks.pool_fns"], checkpoint_roots=[directory]))
    alone: float | None = None
    rows = []
    for n in args.tenants:
      results = run_tenants(cluster, directory, n, args.seconds)
      rates = [results[t][0] for t in TENANTS[:n]]
      if n == 1:
        alone = rates[0]
      for t in TENANTS[:n]:
        rate, saves = results[t]
        rows.append([n, t, f"{rate:.1f}", f"{saves:.2f}",
                     f"{rate / alone:.2f}" if alone else "-",
                     f"{rate * n / alone:.2f}" if alone else "-", f"{jain(rates):.3f}"])
    print(f"## {len(args.tenants)} runs of {args.seconds:g} s: each tenant feeds {BATCH} x 16 "
          f"KiB rows a batch and saves {STATE_BYTES >> 20} MiB every {SAVE_EVERY} batches\n")
    print(table(["tenants", "tenant", "batches/s", "saves/s", "vs alone",
                 "vs fair share (alone/N)", "Jain's fairness"], rows))
    took, refused = join_during_flood(cluster)
    print(f"\na tenant's join during another's handshake flood, {len(took)} times: median "
          f"{took[len(took) // 2] * 1e3:.0f} ms, most {took[-1] * 1e3:.0f} ms (t3 refused "
          f"{refused} handshakes meanwhile, past its sessions={FLOOD_SESSIONS})")
    for fn in ("size_of", "echo"):
      print(f"one 128 MiB inline call ({fn}): sidecar peak RSS +{inline_growth(cluster, fn):.2f}x "
            "the payload")


if __name__ == "__main__":
  main()
