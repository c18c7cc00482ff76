"""How the feed scales with the host's cores: one pipeline delivered to jax.Arrays, per N cores.

Run from the repository root (not run by CI)::

  python -m benchmarks.feed --transform heavy --cores 1,2,4,8,12 --out "$OUT"

Per element: a 224x224x3 image, batch 32 (``benchmarks/feed_elements.py``): ``noop`` (transport
alone), ``light`` (numpy flip and brightness) or ``heavy`` (JPEG decode, random-resized crop,
flip, uint8: the vision example's transform, ``pipelines/images.py``).

Rows, measured in one run:
- *one core*: the pipeline's batches made in one thread of this process (each element read,
  each leaf stacked), nothing else running: the rate every other row is held against.
- *N processes, no transport*: N processes each doing the same, all at once, with nothing
  moved anywhere: what the host's cores give this pipeline (on hosts whose cores share
  physical cores or memory bandwidth, less than N x one core).
- *ours*: ``ctl.feed(workers=N)`` on a 1-host LocalCluster, into jax.Arrays, with the
  trainer's wait per step, the sidecar main process's CPU per batch (all its threads,
  from /proc) and its workers' CPU per batch beyond one core's.
- *Grain mp_prefetch(N)*, its start (to the first batch) timed apart from its rate.
- *Grain in-process* (once): ``to_iter_dataset()`` with Grain's default 16 threads, so it
  may use more than one core.

Each path warms up ``--warmup`` seconds after its first batch, then is measured for
``--seconds``. With ``--out DIR`` the rows are also written to ``DIR/feed_<transform>.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import tempfile
import time

import absl.flags
import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks import feed_elements, feed_fns
from benchmarks.common import table

BATCH = 32
PREFETCH = 4
DEVICE_PREFETCH = 8  # what ctl.feed keeps ahead on an accelerator (jax/feed.DEVICE_PREFETCH)


def cpu_seconds(pid: int) -> float:
  """CPU seconds of process ``pid``: its live threads' from /proc's schedstat, to the
  nanosecond, where the kernel keeps it (its stat counts 10 ms ticks, too coarse for a few
  dozen batches of a heavy pipeline); else from its stat."""
  if os.path.exists(f"/proc/{pid}/schedstat"):
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
      try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
          total += int(f.read().split()[0])
      except OSError:
        pass  # the thread ended meanwhile
    return total / 1e9
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
  out = []
  for tid in os.listdir(f"/proc/{pid}/task"):
    try:
      with open(f"/proc/{pid}/task/{tid}/children") as f:
        out += [int(c) for c in f.read().split()]
    except OSError:
      pass  # the thread ended meanwhile
  return out


def own_cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


class Measured:
  """What one path delivered: batches/s, the trainer's mean wait per step (ms), the seconds
  to its first batch, and CPU seconds per batch of the processes watched."""

  def __init__(self, per_s: float, wait_ms: float, start_s: float, cpu: dict[str, float]):
    self.per_s, self.wait_ms, self.start_s, self.cpu = per_s, wait_ms, start_s, cpu


def consume(iterator, *, warmup: float, seconds: float, watch: dict[str, list[int]] | None = None
            ) -> Measured:
  """Pulls batches into jax.Arrays (as a trainer would, each used at once); times the first
  batch, warms up, then measures. ``watch``: name -> pids whose CPU per batch is reported
  (the name ``consumer`` is this process)."""
  device = jax.devices()[0]
  put = lambda b: jax.block_until_ready(jax.device_put(b, device))
  t0 = time.perf_counter()
  put(next(iterator))
  start_s = time.perf_counter() - t0
  while time.perf_counter() - t0 < start_s + warmup:
    put(next(iterator))
  watch = watch or {}
  before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in watch.items()}
  mine = own_cpu()
  n, waited, t0 = 0, 0.0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    w = time.perf_counter()
    batch = next(iterator)
    waited += time.perf_counter() - w
    put(batch)
    n += 1
  elapsed = time.perf_counter() - t0
  cpu = {k: (sum(cpu_seconds(p) for p in pids) - before[k]) / n for k, pids in watch.items()}
  cpu["consumer"] = (own_cpu() - mine) / n
  return Measured(n / elapsed, waited / n * 1e3, start_s, cpu)


def make_batches(element, start: int, seconds: float) -> tuple[int, float]:
  """Batches made in this thread for ``seconds`` from ``element(i)``, each leaf stacked as a
  feed worker stacks it; returns (batches, CPU seconds this process spent)."""
  n, i, c0, t0 = 0, start, time.process_time(), time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    feed_elements.batch_of([element(j) for j in range(i, i + BATCH)])
    n, i = n + 1, i + BATCH
  return n, time.process_time() - c0


def one_core(kind: str, jpegs: str | None, seconds: float) -> tuple[float, float]:
  """(batches/s, CPU ms a batch) of the pipeline in one thread of this process."""
  element = feed_elements.element_fn(kind, jpegs)
  make_batches(element, 0, min(1.0, seconds))  # warm: first reads, the allocator
  t0 = time.perf_counter()
  n, cpu = make_batches(element, 10_000, seconds)
  return n / (time.perf_counter() - t0), cpu / n * 1e3


def _bare(kind: str, jpegs: str | None, seconds: float, k: int, barrier, results) -> None:
  element = feed_elements.element_fn(kind, jpegs)
  make_batches(element, 0, 0.5)
  barrier.wait()
  results.put(make_batches(element, 20_000 + 5_000 * k, seconds)[0])


def bare_processes(kind: str, jpegs: str | None, n: int, seconds: float) -> tuple[float, float]:
  """(batches/s, seconds to start) of ``n`` spawned processes making batches at once: no
  Grain, no sidecar imported (``feed_elements``), nothing moved."""
  ctx = multiprocessing.get_context("spawn")
  barrier, results = ctx.Barrier(n + 1), ctx.Queue()
  t0 = time.perf_counter()
  procs = [ctx.Process(target=_bare, args=(kind, jpegs, seconds, k, barrier, results))
           for k in range(n)]
  for p in procs:
    p.start()
  try:
    barrier.wait(timeout=300)
    start_s = time.perf_counter() - t0
    total = sum(results.get(timeout=seconds + 120) for _ in procs)
  finally:
    for p in procs:
      p.join(timeout=30)
      if p.is_alive():
        p.kill()
  return total / seconds, start_s


def ours(ctl, cluster, kind: str, jpegs: str | None, n: int, *, warmup: float,
         seconds: float) -> Measured:
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  main = cluster.pid(0)
  t0 = time.perf_counter()
  with ctl.feed("bench_images", kwargs={"kind": kind, "jpegs": jpegs}, global_batch_size=BATCH,
                sharding=sharding, options=sidecar.FeedOptions(workers=n, prefetch=PREFETCH)
                ) as feed:
    next(feed)  # once the workers have started: they are children of the sidecar now
    start_s = time.perf_counter() - t0
    m = consume(feed, warmup=warmup, seconds=seconds,
                watch={"main": [main], "workers": children(main)})
  m.start_s = start_s
  return m


def grain_mp(kind: str, jpegs: str | None, n: int, *, warmup: float, seconds: float
             ) -> Measured:
  ds = feed_fns.dataset(kind, jpegs).repeat().batch(BATCH).to_iter_dataset().mp_prefetch(
      grain.MultiprocessingOptions(num_workers=n))
  it = iter(ds)
  try:
    return consume(it, warmup=warmup, seconds=seconds)
  finally:
    del it


def grain_inprocess(kind: str, jpegs: str | None, *, warmup: float, seconds: float) -> Measured:
  it = iter(feed_fns.dataset(kind, jpegs).repeat().batch(BATCH).to_iter_dataset())
  return consume(it, warmup=warmup, seconds=seconds)


def shm_size_for(kind: str, cores: list[int]) -> str:
  """An arena that holds every batch a feed of the most workers keeps at once (those in
  flight in the workers, sent ahead, on the device, the trainer's), with room to spare."""
  image = (224 * 224 * 3) * (4 if kind == "heavy" else 1)
  held = 2 * max(cores) + PREFETCH + DEVICE_PREFETCH + 4
  need = held * BATCH * image * 1.5
  return f"{max(1, -(-int(need) // (1 << 30)))}GiB"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--transform", choices=("noop", "light", "heavy"), default="light")
  ap.add_argument("--cores", default="1,2,4", help="N values, comma-separated (e.g. 1,2,4,8,12)")
  ap.add_argument("--seconds", type=float, default=4.0, help="each path's measured time")
  ap.add_argument("--warmup", type=float, default=3.0, help="each path's warm-up after its "
                  "first batch (Grain mp_prefetch needed ~8 s here once: raise it to check)")
  ap.add_argument("--skip", default="", help="paths to leave out: grain_mp,bare,inprocess")
  ap.add_argument("--out", default=None, help="a directory for feed_<transform>.json")
  args = ap.parse_args()
  absl.flags.FLAGS.mark_as_parsed()  # Grain's multiprocessing reads absl flags.
  cores = [int(c) for c in args.cores.split(",")]
  skip = set(filter(None, args.skip.split(",")))
  kind, timing = args.transform, dict(warmup=args.warmup, seconds=args.seconds)
  began = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="feed-bench-") as tmp:
    jpegs = feed_elements.write_jpegs(tmp) if kind == "heavy" else None
    base, base_cpu_ms = one_core(kind, jpegs, args.seconds)
    print(f"one core: {base:.1f} batches/s ({base_cpu_ms:.2f} ms CPU a batch)", flush=True)
    rows, records = [], []

    def row(path: str, n: int | None, m: Measured | None = None, per_s: float | None = None,
            start_s: float | None = None, ceiling: float | None = None) -> None:
      per_s = m.per_s if m is not None else per_s
      assert per_s is not None
      record = {"transform": kind, "path": path, "n": n, "batches_per_s": per_s,
                "vs_n_cores": per_s / (base * (n or 1)), "start_s": start_s}
      cells = [kind, path, "-" if n is None else str(n), f"{per_s:,.1f}",
               f"{record['vs_n_cores']:.2f}", "-" if ceiling is None else f"{per_s / ceiling:.2f}"]
      if m is not None:
        record.update(wait_ms=m.wait_ms, start_s=m.start_s, cpu_ms={k: v * 1e3 for k, v in
                                                                   m.cpu.items()})
        main = m.cpu.get("main")
        worker_extra = m.cpu["workers"] * 1e3 - base_cpu_ms if "workers" in m.cpu else None
        cells += [f"{m.wait_ms:.2f}", "-" if main is None else f"{main * 1e3:.3f}",
                  "-" if main is None else f"{main * per_s:.2f}",
                  "-" if worker_extra is None else f"{worker_extra:+.2f}",
                  f"{m.cpu['consumer'] * 1e3:.2f}"]
      else:
        cells += ["-"] * 5
      cells.append("-" if record["start_s"] is None else f"{record['start_s']:.1f}")
      rows.append(cells)
      records.append(record)
      print("  ".join(cells), flush=True)

    row("one core (1 thread)", 1, per_s=base)
    if "inprocess" not in skip:
      row("Grain in-process (16 threads)", None, grain_inprocess(kind, jpegs, **timing))
    with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1,
                                      shm_size=shm_size_for(kind, cores),
                                      imports=["benchmarks.feed_fns"]) as cluster:
      with cluster.controller() as ctl:
        for n in cores:
          ceiling = None
          if "bare" not in skip:
            ceiling, start_s = bare_processes(kind, jpegs, n, args.seconds)
            row("N processes, no transport", n, per_s=ceiling, start_s=start_s)
          row("ours: ctl.feed(workers=N)", n, ours(ctl, cluster, kind, jpegs, n, **timing),
              ceiling=ceiling)
          if "grain_mp" not in skip:
            row("Grain mp_prefetch(N)", n, grain_mp(kind, jpegs, n, **timing), ceiling=ceiling)
  print(table(("transform", "path", "N", "batches/s", "vs N x one core", "vs N processes",
               "wait ms/step", "main CPU ms/batch", "main cores", "worker CPU ms/batch "
               "beyond one core's", "consumer CPU ms/batch", "start s"), rows))
  print(f"total {time.perf_counter() - began:.0f} s")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"feed_{kind}.json"), "w") as f:
      json.dump({"one_core_per_s": base, "one_core_cpu_ms": base_cpu_ms, "rows": records}, f,
                indent=1)


if __name__ == "__main__":
  main()
