"""Soak: many controllers, feeds and saves against real sidecars for minutes; growth checked.

On a LocalCluster (real ``sidecar serve`` processes) this runs, all at once:

  callers    ``--controllers`` threads, each with its own Controller (half attached to the
             arenas, half over gRPC only), calling ``echo`` (a small array) in a loop;
  churners   a thread that makes a new Controller, handshakes, calls, closes, over and over;
  feeds      ``--feeds`` threads, each iterating a feed and reopening it every 200 batches;
  saves      one thread saving a 2 MiB state (1 MiB a host) every ``--save-every`` s
             (max_to_keep=2).

It samples every sidecar's RSS, threads and open fds, its arena use and its handshake
sessions, and this process's RSS, threads and fds: once after a warm-up, every minute, and
at the end. It prints calls/s, call latency p50/p99/max, feed batches/s, saves, errors,
and the samples side by side, with the growth from the first sample to the last.

  nice -n 19 python -m benchmarks.soak --minutes 10

Not a test: nothing is asserted; the figures are for the reader (docs/security.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from benchmarks.common import pct, table

FNS = ["benchmarks.soak_fns"]


def proc_stats(pid: int) -> dict[str, float]:
  """RSS (MiB), threads and open fds of process ``pid``."""
  out = {}
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        out["rss_mib"] = int(line.split()[1]) / 1024
      elif line.startswith("Threads:"):
        out["threads"] = int(line.split()[1])
  out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
  return out


class Soak:
  def __init__(self, cluster: sidecar.testing.LocalCluster, args: argparse.Namespace):
    self.cluster, self.args = cluster, args
    self.stop = threading.Event()
    self.lock = threading.Lock()
    self.latencies: list[float] = []
    self.calls = 0
    self.batches = 0
    self.saves = 0
    self.churns = 0
    self.errors: collections.Counter[str] = collections.Counter()
    self.samples: list[tuple[float, dict[str, float]]] = []

  def _error(self, where: str, e: BaseException) -> None:
    with self.lock:
      self.errors[f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:80]}"] += 1
    time.sleep(0.1)

  def caller(self, i: int) -> None:
    x = np.arange(256, dtype=np.float32)
    with self.cluster.controller(attach=i % 2 == 0) as ctl:
      hosts = [i % self.cluster.num_hosts]
      while not self.stop.is_set():
        t0 = time.perf_counter()
        try:
          ctl.call("echo", args=(x,), hosts=hosts)
        except sidecar.SidecarError as e:
          self._error("call", e)
          continue
        dt = time.perf_counter() - t0
        with self.lock:
          self.calls += 1
          self.latencies.append(dt)

  def churner(self) -> None:
    while not self.stop.is_set():
      try:
        with self.cluster.controller(attach=self.churns % 2 == 0) as ctl:
          ctl.call("echo", args=(1,))
        with self.lock:
          self.churns += 1
      except sidecar.SidecarError as e:
        self._error("churn", e)

  def feeder(self, i: int) -> None:
    n = self.cluster.num_hosts
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:n]), ("data",)), P("data"))
    with self.cluster.controller() as ctl:
      while not self.stop.is_set():
        try:
          with ctl.feed("soak_rows", global_batch_size=8 * n, sharding=sharding, seed=i,
                        options=sidecar.FeedOptions(prefetch=2)) as feed:
            for _ in range(200):
              if self.stop.is_set():
                break
              batch = next(feed)
              jax.block_until_ready(batch)
              del batch
              with self.lock:
                self.batches += 1
        except sidecar.SidecarError as e:
          self._error("feed", e)

  def saver(self, directory: str) -> None:
    n = self.cluster.num_hosts
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:n]), ("data",)), P("data"))
    state = {"w": jax.device_put(np.ones((n * 256, 1024), np.float32), sharding)}  # 1 MiB/host
    with self.cluster.controller() as ctl:
      ckpt = ctl.checkpointer(directory, max_to_keep=2)
      step = 0
      while not self.stop.wait(self.args.save_every):
        try:
          ckpt.save(step, state).durable.result(timeout=120)
          with self.lock:
            self.saves += 1
        except Exception as e:  # a soak counts every failure, of any kind
          self._error("save", e)
        step += 1
      ckpt.close()

  def sample(self, ctl: sidecar.jax.Controller, t0: float) -> None:
    row: dict[str, float] = {}
    for h in range(self.cluster.num_hosts):
      for k, v in proc_stats(self.cluster.pid(h)).items():
        row[f"sidecar{h} {k}"] = v
    for s in ctl.status():
      h = s.identity.host_id
      row[f"sidecar{h} arena MiB"] = s.arena_used / 2**20
      row[f"sidecar{h} arena blocks"] = s.arena_blocks
      row[f"sidecar{h} workers"] = s.workers
    for k, v in proc_stats(os.getpid()).items():
      row[f"controllers {k}"] = v
    self.samples.append((time.monotonic() - t0, row))

  def run(self) -> None:
    a = self.args
    directory = tempfile.mkdtemp(prefix="sidecar-soak-")
    threads = [threading.Thread(target=self.caller, args=(i,)) for i in range(a.controllers)]
    threads += [threading.Thread(target=self.feeder, args=(i,)) for i in range(a.feeds)]
    threads += [threading.Thread(target=self.churner),
                threading.Thread(target=self.saver, args=(directory,))]
    with self.cluster.controller(attach=False) as probe:
      t0 = time.monotonic()
      for t in threads:
        t.start()
      self.stop.wait(a.warmup)
      with self.lock:
        self.latencies.clear()
        calls0, batches0, saves0 = self.calls, self.batches, self.saves
      self.sample(probe, t0)
      started = time.monotonic()
      end = started + a.minutes * 60
      while time.monotonic() < end:
        time.sleep(min(60.0, max(0.0, end - time.monotonic())))
        self.sample(probe, t0)
      elapsed = time.monotonic() - started
      self.stop.set()
      for t in threads:
        t.join(180)
      with self.lock:
        lat = sorted(self.latencies)
        calls, batches, saves = self.calls - calls0, self.batches - batches0, self.saves - saves0
    self.report(elapsed, lat, calls, batches, saves)

  def report(self, elapsed: float, lat: list[float], calls: int, batches: int,
             saves: int) -> None:
    a = self.args
    print(f"\nsoak: {a.minutes:g} min measured after {a.warmup:g} s warm-up; {a.controllers} "
          f"calling controllers, {a.feeds} feeds, 1 churning controller, 1 saver "
          f"(every {a.save_every:g} s); {self.cluster.num_hosts} sidecars\n")
    ms = lambda s: f"{s * 1e3:.2f}"
    print(table(["figure", "value"], [
        ["calls", calls], ["calls/s", f"{calls / elapsed:.0f}"],
        ["call p50 ms", ms(pct(lat, 50)) if lat else "-"],
        ["call p99 ms", ms(pct(lat, 99)) if lat else "-"],
        ["call max ms", ms(lat[-1]) if lat else "-"],
        ["feed batches", batches], ["feed batches/s", f"{batches / elapsed:.1f}"],
        ["saves (durable)", saves], ["controllers made and closed", self.churns],
        ["errors", sum(self.errors.values())]]))
    for what, n in self.errors.most_common(10):
      print(f"  {n} x {what}")
    keys = list(self.samples[0][1])
    header = ["t (s)"] + keys
    rows = [[f"{t:.0f}"] + [f"{row.get(k, 0):.1f}" if isinstance(row.get(k), float)
                             else row.get(k, "-") for k in keys] for t, row in self.samples]
    first, last = self.samples[0][1], self.samples[-1][1]
    print("\n" + table(["measure", "start", "end", "growth"], [
        [k, f"{first[k]:.1f}", f"{last[k]:.1f}", f"{last[k] - first[k]:+.1f}"] for k in keys]))
    if a.verbose:
      print("\n" + table(header, rows))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--minutes", type=float, default=10.0)
  ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the first sample")
  ap.add_argument("--hosts", type=int, default=2)
  ap.add_argument("--controllers", type=int, default=8)
  ap.add_argument("--feeds", type=int, default=2)
  ap.add_argument("--save-every", type=float, default=5.0)
  ap.add_argument("--verbose", action="store_true", help="print every sample")
  args = ap.parse_args()
  with sidecar.testing.LocalCluster(num_hosts=args.hosts, devices_per_host=1,
                                    shm_size="128MiB", imports=FNS) as cluster:
    Soak(cluster, args).run()


if __name__ == "__main__":
  main()
