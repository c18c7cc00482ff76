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

Then the misbehaving-tenant rows: t0 and t1 feed and save as above while a third tenant
misbehaves for the whole window: t3 runs 16 feed worker processes (in feeds of as many
workers as the sidecar allows one feed; its ``feed_workers: 16`` lets it), t4 asks for 16
past its ``feed_workers: 4`` (refused: it runs the 4 it may), t3 floods handshakes, sends
128 MiB inline calls in a loop, or fills its ``arena_ceiling`` and keeps asking past it.
Each well-behaved tenant's rate is set against its rate among three equal tenants (t0, t1,
t2: its fair share); the target is >= 0.80. ``--repeat`` runs each configuration again,
for the spread.

The machine's cores are shared too: on 2 cores, four trainers and their feeds compete
for CPU as much as for the pool, so "vs alone" there includes the machine's share.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time

import grpc
import numpy as np

import sidecar
from benchmarks.attacks import _proc, _reset_peak
from benchmarks.common import table
from sidecar._src.arena import shm
from sidecar._src.server.arenas import arenas as arenas_lib, leases as leases_lib
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

TENANTS = ("t0", "t1", "t2", "t3")
BATCH = 64  # rows of 16 KiB: 1 MiB a batch
SAVE_EVERY = 50
STATE_BYTES = 4 << 20
FLOOD_SESSIONS = 8  # the flooding tenant's session quota
HOG_WORKERS = 16  # the feed workers a misbehaving tenant runs
REFUSED_WORKERS = 4  # t4's feed_workers quota: it asks for HOG_WORKERS
INLINE_MIB = 128
POOL = f"""\
tenants:
  - {{name: t0, token_file: t0.token, arena: 0.2, checkpoint_roots: [t0]}}
  - {{name: t1, token_file: t1.token, arena: 0.2, checkpoint_roots: [t1]}}
  - {{name: t2, token_file: t2.token, arena: 0.2, checkpoint_roots: [t2]}}
  - {{name: t3, token_file: t3.token, arena: 0.2, checkpoint_roots: [t3], \
sessions: {FLOOD_SESSIONS},
     feed_workers: {HOG_WORKERS}, arena_ceiling: 0.35, inline_bytes: {2 * INLINE_MIB}MiB}}
  - {{name: t4, token_file: t4.token, arena: 8MiB, checkpoint_roots: [t4],
     feed_workers: {REFUSED_WORKERS}}}
"""
# The misbehaving rows: (label, tenant, what it does).
# The flood last: its sessions stay counted for 60 s after it.
MISBEHAVING = {"feed": ("16 feed workers", "t3", "feed"),
               "feed-quota": ("16 feed workers, quota 4", "t4", "feed"),
               "inline": (f"{INLINE_MIB} MiB inline calls", "t3", "inline"),
               "fill": ("fills its arena ceiling", "t3", "fill"),
               "flood": ("handshake flood", "t3", "flood")}


# --no-pool: every trainer presents this one token (the same trainers, no pool file).
SHARED = "shared"


def token(name: str) -> str:
  return f"benchmark-token-of-{name}"


def write_pool(directory: str, text: str = POOL, names: tuple[str, ...] = (*TENANTS, "t4")
               ) -> str:
  """``text`` as ``directory``/pool.yaml, each of ``names`` with its token file and
  checkpoint root; the pool file's path."""
  for name in names:
    path = os.path.join(directory, f"{name}.token")
    with open(path, "w") as f:
      f.write(token(name))
    os.chmod(path, 0o600)
    os.makedirs(os.path.join(directory, name), exist_ok=True)
  path = os.path.join(directory, "pool.yaml")
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, 0o600)
  return path


def tenant(name: str, addresses: list[str], directory: str, start_at: float, seconds: float,
           out: multiprocessing.Queue, shared: bool = False) -> None:
  """One tenant's trainer: feeds and saves from ``start_at`` for ``seconds``; ``shared``:
  it presents the one shared token (``--no-pool``), not its own."""
  os.environ["SIDECAR_TOKEN"] = token(SHARED if shared else name)
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  state = {"w": np.ones(STATE_BYTES // 4, np.float32)}
  with sidecar.jax.Controller(addresses, timeout=120) as ctl, \
      ctl.feed("rows", global_batch_size=BATCH, sharding=sharding) as feed, \
      ctl.checkpointer(os.path.join(directory, name, f"ck-{start_at:.0f}"),  # one per run
                       max_to_keep=2) as ckpt:
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


def misbehave(name: str, kind: str, addresses: list[str], socket: str, start_at: float,
              seconds: float, out: multiprocessing.Queue) -> None:
  """Tenant ``name`` misbehaves (``kind``: feed, flood, inline or fill) from just before
  ``start_at`` until just after the window of ``seconds``; puts (name, what it did)."""
  os.environ["SIDECAR_TOKEN"] = token(name)
  try:
    if kind == "feed":  # its workers start before the window (else it measures their start)
      did = hog_feeds(addresses, start_at, start_at + seconds + 2.0)
    else:
      time.sleep(max(0.0, start_at - 2.0 - time.time()))
      did = _misbehave(name, kind, addresses, socket, start_at + seconds + 2.0)
    out.put((name, did))
  except Exception as e:  # reported in the table: the run goes on
    out.put((name, f"failed: {type(e).__name__}: {str(e)[:80]}"))


def _misbehave(name: str, kind: str, addresses: list[str], socket: str, end: float) -> str:
  if kind == "flood":
    refused = multiprocessing.Value("l", 0)
    flood(addresses[0], end - time.time(), refused, name=name)
    return f"{refused.value} of its handshakes refused (sessions={FLOOD_SESSIONS})"
  if kind == "inline":
    calls = 0
    big = np.ones(INLINE_MIB << 20, np.uint8)
    with sidecar.jax.Controller(addresses, attach=False, timeout=120) as ctl:
      while time.time() < end:
        ctl.call("size_of", args=(big,))
        calls += 1
    return f"{calls} calls of {INLINE_MIB} MiB"
  from sidecar._src.arena.worker import Worker
  held, refusals, error = [], 0, ""
  with Worker(socket, token=token(name)) as hog:
    while time.time() < end:
      try:
        held.append(hog.empty((1 << 20,), np.uint8, timeout=0))  # else: it queues
      except sidecar.ResourceExhaustedError as e:
        refusals, error = refusals + 1, str(e)
        time.sleep(0.001)
    n = len(held)
    del held
  return f"held {n} MiB, refused {refusals} times: {error[:60]}..."


def hog_feeds(addresses: list[str], start_at: float, end: float) -> str:
  """Opens feeds until it runs HOG_WORKERS feed workers or is refused; drains them all as
  fast as it can until ``end``."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from sidecar._src.server.feeds.producer import MAX_WORKERS
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  per_feed = min(HOG_WORKERS, MAX_WORKERS)
  refused = ""
  with sidecar.jax.Controller(addresses, timeout=120) as ctl, contextlib.ExitStack() as stack:
    feeds = []
    try:
      for _ in range(HOG_WORKERS // per_feed):
        feed = stack.enter_context(ctl.feed("rows", global_batch_size=BATCH, sharding=sharding,
                                            options=sidecar.FeedOptions(workers=per_feed)))
        jax.block_until_ready(next(feed))
        feeds.append(feed)
    except sidecar.ResourceExhaustedError as e:
      refused = f"; refused: {str(e)[:70]}..."
    late = time.time() - start_at  # > 0: its workers were still starting in the window
    batches = 0
    while time.time() < end:
      for feed in feeds:
        jax.block_until_ready(next(feed))
        batches += time.time() >= start_at
  return (f"{len(feeds)} feeds x {per_feed} workers, {batches} batches in the window"
          f"{f', ready {late:.0f} s late' if late > 0 else ''}{refused}")


def run_tenants(cluster, directory: str, names: tuple[str, ...], seconds: float,
                bad: tuple[str, str] | None = None) -> tuple[dict[str, tuple], str]:
  """Tenants ``names`` at once, and ``bad`` = (tenant, kind) misbehaving meanwhile; each
  well-behaved one's (batches/s, saves/s), and what the misbehaving one did."""
  ctx = multiprocessing.get_context("spawn")
  out = ctx.Queue()
  # After every trainer imported JAX and warmed its feed (and a hog started its workers).
  start_at = time.time() + (60.0 if bad is not None and bad[1] == "feed" else 25.0)
  procs = [ctx.Process(target=tenant, args=(name, list(cluster.addresses), directory,
                                            start_at, seconds, out, cluster.pool is None))
           for name in names]
  if bad is not None:
    procs.append(ctx.Process(target=misbehave, args=(*bad, list(cluster.addresses),
                                                     cluster.socket(0), start_at, seconds, out)))
  got = gather(procs, out, timeout=seconds + 240)
  results = {r[0]: (r[1], r[2]) for r in got if len(r) == 3}
  did = next((r[1] for r in got if len(r) == 2), "")
  return results, did


def gather(procs: list, out, *, timeout: float) -> list:
  """Starts ``procs``, takes one answer of each from ``out``, then joins them (killing one
  that has not ended 30 s later)."""
  for p in procs:
    p.start()
  try:
    return [out.get(timeout=timeout) for _ in procs]
  finally:
    for p in procs:
      p.join(30)
      if p.is_alive():
        p.kill()
        p.join()


def jain(rates: list[float]) -> float:
  return sum(rates) ** 2 / (len(rates) * sum(r * r for r in rates)) if rates else 0.0


def flood(address: str, seconds: float, refused, name: str = "t3") -> None:
  """Tenant ``name``'s handshakes, as fast as one process sends them, for ``seconds``."""
  end = time.monotonic() + seconds
  with grpc.insecure_channel(address) as channel:
    handshake = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                                    request_serializer=pb.HandshakeRequest.SerializeToString)
    while time.monotonic() < end:
      try:
        handshake(pb.HandshakeRequest(versions=protocol.local_versions()), timeout=10,
                  metadata=((protocol.AUTH_KEY, f"Bearer {token(name)}"),))
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
      with sidecar.jax.Controller(cluster.addresses, token=token("t0"), attach=False,
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
  with sidecar.jax.Controller(cluster.addresses, token=token("t1"), attach=False,
                          timeout=120) as ctl:
    ctl.call(fn, args=(np.ones(1 << 20, np.uint8),))  # warm
    big = np.ones(mib << 20, np.uint8)
    time.sleep(0.5)
    _reset_peak(cluster.pid(0))
    before, _ = _proc(cluster.pid(0))
    ctl.call(fn, args=(big,))
    after, _ = _proc(cluster.pid(0))
  return (after - before) / mib


def equal_rows(cluster, directory: str, counts: list[int], seconds: float) -> list[list]:
  """The equal-tenant rows: N = ``counts`` tenants at once, against one alone."""
  alone: float | None = None
  rows = []
  for n in counts:
    _, cpu = _proc(cluster.pid(0))
    results, _ = run_tenants(cluster, directory, TENANTS[:n], seconds)
    rates = [results[t][0] for t in TENANTS[:n]]
    # The sidecar's CPU (its own process: the arenas, quotas, saves; not its feed workers)
    # over the run, warm-up included, per batch of the window: robust to the machine's
    # other load, as the rates are not.
    cpu_ms = (_proc(cluster.pid(0))[1] - cpu) * 1e3 / max(sum(rates) * seconds, 1.0)
    if n == 1:
      alone = rates[0]
    for t in TENANTS[:n]:
      rate, saves = results[t]
      rows.append([n, t, f"{rate:.1f}", f"{saves:.2f}",
                   f"{rate / alone:.2f}" if alone else "-",
                   f"{rate * n / alone:.2f}" if alone else "-", f"{jain(rates):.3f}",
                   f"{cpu_ms:.2f}"])
  return rows


def misbehaving_rows(cluster, directory: str, seconds: float, repeat: int,
                     kinds: list[str]) -> list[list]:
  """t0 and t1 feed and save while a third tenant misbehaves; their rates against their
  fair share (their rates among three equal tenants), each configuration ``repeat`` times."""
  well = TENANTS[:2]
  fair: dict[str, list[float]] = {t: [] for t in well}
  for _ in range(repeat):
    results, _ = run_tenants(cluster, directory, TENANTS[:3], seconds)
    for t in well:
      fair[t].append(results[t][0])
  share = {t: sum(r) / len(r) for t, r in fair.items()}
  rows = [["3 equal (fair share)", t, " / ".join(f"{r:.1f}" for r in fair[t]), "1.00", "-", ""]
          for t in well]
  for label, bad, kind in (MISBEHAVING[k] for k in kinds):
    rates: dict[str, list[float]] = {t: [] for t in well}
    did = []
    for _ in range(repeat):
      results, what = run_tenants(cluster, directory, well, seconds, bad=(bad, kind))
      did.append(what)
      for t in well:
        rates[t].append(results[t][0])
    for t in well:
      ratios = [r / share[t] for r in rates[t]]
      rows.append([f"{bad}: {label}", t, " / ".join(f"{r:.1f}" for r in rates[t]),
                   " / ".join(f"{x:.2f}" for x in ratios),
                   "yes" if min(ratios) >= 0.8 else "NO", did[0] if t == well[0] else ""])
      print("measured:", rows[-1], flush=True)
  return rows


def arena_rows(rounds: int = 5, blocks: int = 4000, size_mib: int = 32) -> list[list]:
  """What one block costs the sidecar in a busy pool's arenas (one memfd per tenant, pages
  made as written, punched past the size) against one pre-faulted arena, in this process:
  four tenants each keep their last 4 blocks of 1 MiB and, every 50th, a 4 MiB one for the
  next 100 (a save in the RAM tier), written as their Workers would. Median of ``rounds``."""
  size = size_mib << 20

  def run(per_tenant: bool) -> tuple[float, int]:
    arenas = (arenas_lib.Arenas(size, per_tenant=True, ceiling_of=lambda name: size)
              if per_tenant else arenas_lib.Arenas.single(shm.Arena.create(size)))
    leases = leases_lib.Leases(arenas)
    live: dict[str, collections.deque] = {t: collections.deque() for t in TENANTS}
    kept: collections.deque = collections.deque()
    start = time.perf_counter()
    for i in range(blocks):
      t = TENANTS[i % len(TENANTS)]
      nbytes = 4 << 20 if i % 50 == 0 else 1 << 20
      with tenants_lib.acting_as(t):
        pin = leases.new_pin()
        block = leases.alloc(nbytes, pin, timeout=5)
      leases.arena_of(block).view(block.offset, block.nbytes)[::4096] = 1  # its pages
      (kept if nbytes > 1 << 20 else live[t]).append((block, pin, i))
      while len(live[t]) > 4 or (kept and kept[0][2] < i - 100):
        b, p, _ = live[t].popleft() if len(live[t]) > 4 else kept.popleft()
        leases.release(b.offset, b.generation, p)
    took = (time.perf_counter() - start) / blocks
    for b, p, _ in [*kept, *(x for q in live.values() for x in q)]:
      leases.release(b.offset, b.generation, p)
    punches = getattr(arenas, "punches", 0)
    arenas.close()
    return took, punches

  rows = []
  for per_tenant in (False, True):
    runs = [run(per_tenant) for _ in range(rounds)]
    rows.append(["one arena (no pool)" if not per_tenant else "an arena per tenant (pool)",
                 f"{statistics.median(r[0] for r in runs) * 1e6:.1f}",
                 " / ".join(f"{r[0] * 1e6:.0f}" for r in runs),
                 f"{statistics.median(r[1] for r in runs) / blocks:.4f}"])
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seconds", type=float, default=10.0, help="each run's measured seconds")
  ap.add_argument("--tenants", type=int, nargs="*", default=[1, 2, 4], choices=[1, 2, 4],
                  help="the equal-tenant runs (none: skip them)")
  ap.add_argument("--repeat", type=int, default=2,
                  help="runs of each misbehaving configuration (0: skip them)")
  ap.add_argument("--misbehaving", nargs="+", default=list(MISBEHAVING),
                  choices=list(MISBEHAVING), help="the misbehaving rows to run")
  ap.add_argument("--no-extras", action="store_true",
                  help="skip the join during a flood and the inline calls' RSS")
  ap.add_argument("--arenas", action="store_true",
                  help="only the arenas' cost per block in a busy pool, in this process")
  ap.add_argument("--no-pool", action="store_true",
                  help="the equal-tenant rows with one shared token and one arena, no pool "
                  "file (the baseline of the pool's cost); the other rows are skipped")
  args = ap.parse_args()
  if args.arenas:
    print("## a block's cost in a busy pool's arenas: 4 tenants on 32 MiB, 4,000 blocks\n")
    print(table(["arenas", "us per block (median)", "each run", "punches per block"],
                arena_rows()))
    return
  with contextlib.ExitStack() as stack:
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="sidecar-pool-"))
    if args.no_pool:
      write_pool(directory)  # the checkpoint roots
      args.repeat, args.no_extras = 0, True
    cluster = stack.enter_context(sidecar.testing.LocalCluster(
        1, 1, shm_size="256MiB", pool=None if args.no_pool else write_pool(directory),
        token=token(SHARED) if args.no_pool else None, configure_jax=False,
        imports=["benchmarks.pool_fns"], checkpoint_roots=[directory]))
    what = (f"each tenant feeds {BATCH} x 16 KiB rows a batch and saves "
            f"{STATE_BYTES >> 20} MiB every {SAVE_EVERY} batches")
    if args.tenants:
      rows = equal_rows(cluster, directory, args.tenants, args.seconds)
      mode = "one shared token, no pool" if args.no_pool else "a pool of tenants"
      print(f"## {len(args.tenants)} runs of {args.seconds:g} s ({mode}): {what}\n")
      print(table(["tenants", "tenant", "batches/s", "saves/s", "vs alone",
                   "vs fair share (alone/N)", "Jain's fairness", "sidecar CPU ms/batch"], rows))
    if args.repeat:
      rows = misbehaving_rows(cluster, directory, args.seconds, args.repeat,
                              args.misbehaving)
      print(f"\n## a misbehaving tenant, {args.repeat} runs of {args.seconds:g} s each: {what}\n")
      print(table(["misbehaving", "tenant", "batches/s (each run)", "vs fair share",
                   ">= 0.80", "what it did (first run)"], rows))
    if args.no_extras:
      return
    took, refused = join_during_flood(cluster)
    print(f"\na tenant's join during another's handshake flood, {len(took)} times: median "
          f"{took[len(took) // 2] * 1e3:.0f} ms, most {took[-1] * 1e3:.0f} ms (t3 refused "
          f"{refused} handshakes meanwhile, past its sessions={FLOOD_SESSIONS})")
    for fn in ("size_of", "echo"):
      print(f"one 128 MiB inline call ({fn}): sidecar peak RSS +{inline_growth(cluster, fn):.2f}x "
            "the payload")


if __name__ == "__main__":
  main()
