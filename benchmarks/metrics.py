"""What Prometheus metrics cost on the hot paths, and the dashboard's panels from a run.

Run from the repository root: ``python -m benchmarks.metrics [--png docs/metrics.png]``.
Not run by CI.

Three 1-host LocalClusters side by side: two without metrics (their ratio is the noise
floor, an A/A check) and one with ``--metrics-port`` (scraped once a second by a thread
here, a busier scrape than Prometheus's usual 15 s). Measured in rounds that rotate
the order, so drift on a shared machine hits all alike: the
``ctl.call`` round trip (p50 of N calls of a registered echo) and ``ctl.feed``
batches/s (batch 64 of small rows: the per-batch path, not the copy), and the sidecar
process's CPU time per call and per batch (from /proc, summed over the rounds: less
sensitive than wall time to what else the machine runs). Prints medians over the
rounds and on/off ratios. Then, on the metrics cluster, a short training-like
run (a feed, calls, a save every few seconds) is scraped twice a second and, with
``--png``, drawn as the panels of ``k8s/grafana/sidecar-dashboard.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
import urllib.request

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from prometheus_client.parser import text_string_to_metric_families

import sidecar
from benchmarks.common import latencies, pct, table

FNS = ["benchmarks.metrics_fns"]
BATCH = 64


def scrape(url: str) -> dict[tuple[str, tuple], float]:
  with urllib.request.urlopen(url, timeout=10) as r:
    text = r.read().decode()
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for f in text_string_to_metric_families(text) for s in f.samples}


class Scraper:
  """Scrapes ``url`` every ``period`` seconds on a thread of its own, keeping each result."""

  def __init__(self, url: str, period: float):
    self.url, self.period = url, period
    self.samples: list[tuple[float, dict]] = []
    self.durations_ms: list[float] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="bench-scraper")

  def _run(self) -> None:
    while not self._stop.is_set():
      t0 = time.monotonic()
      self.samples.append((t0, scrape(self.url)))
      self.durations_ms.append((time.monotonic() - t0) * 1e3)
      self._stop.wait(self.period)

  def __enter__(self) -> Scraper:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join(10)


def cpu_s(pid: int) -> float:
  """User + system CPU seconds of process ``pid`` so far."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def call_p50_us(ctl, n: int, pid: int) -> tuple[float, float, int]:
  """p50 round trip, and the sidecar's CPU seconds over ``n`` calls."""
  c0 = cpu_s(pid)
  p50 = pct(latencies(lambda: ctl.call("bench_echo", args=(1,)), n=n, warmup=0), 50) * 1e6
  return p50, cpu_s(pid) - c0, n


def feed_rate(ctl, sharding, seconds: float, pid: int) -> tuple[float, float, int]:
  """Batches/s, and the sidecar's CPU seconds over the batches taken."""
  with ctl.feed("bench_small", global_batch_size=BATCH, sharding=sharding,
                options=sidecar.FeedOptions(prefetch=4)) as feed:
    for _ in range(20):
      next(feed)
    n, t0, c0 = 0, time.perf_counter(), cpu_s(pid)
    while time.perf_counter() - t0 < seconds:
      jax.block_until_ready(next(feed))
      n += 1
    return n / (time.perf_counter() - t0), cpu_s(pid) - c0, n


def recorder_us(n: int = 200_000) -> float:
  """What one call costs the sidecar in the metrics code: label, in-flight, count, latency."""
  from sidecar._src.server import metrics as metrics_lib
  from sidecar._src.user import registry as registry_lib
  reg = registry_lib.Registry()
  reg.add(registry_lib.FUNCTION, "bench_echo", lambda x: x)
  m = metrics_lib.Metrics(lambda: None)  # type: ignore[arg-type,return-value]

  def one():
    m.call_started("call")
    t0 = time.perf_counter()
    name = "bench_echo" if reg.has(registry_lib.FUNCTION, "bench_echo") else "?"
    m.call_done("call", name, "OK", time.perf_counter() - t0)
  for _ in range(1000):
    one()
  t0 = time.perf_counter()
  for _ in range(n):
    one()
  return (time.perf_counter() - t0) / n * 1e6


def record(results, cpu, k: str, path: str, measured: tuple[float, float, int]) -> None:
  value, seconds, n = measured
  results[k][path].append(value)
  cpu[k][path][0] += seconds
  cpu[k][path][1] += n


def overhead(args, clusters, sharding) -> None:
  """Alternating rounds over "off", "off again" (the noise floor) and "on"."""
  results = {k: {"call": [], "feed": []} for k in clusters}
  cpu = {k: {"call": [0.0, 0], "feed": [0.0, 0]} for k in clusters}  # [seconds, calls]
  url = clusters["on"].metrics_urls[0] if args.scrape_period > 0 else None
  with contextlib.ExitStack() as stack:
    ctls = {k: stack.enter_context(c.controller()) for k, c in clusters.items()}
    scraper = stack.enter_context(Scraper(url, args.scrape_period)) if url else None
    keys = list(clusters)
    for r in range(args.rounds):
      order = keys[r % len(keys):] + keys[:r % len(keys)]
      for k in order:
        for _ in range(50):
          ctls[k].call("bench_echo", 1)  # warm up
        record(results, cpu, k, "call", call_p50_us(ctls[k], args.calls, clusters[k].pid(0)))
      for k in order:
        record(results, cpu, k, "feed",
               feed_rate(ctls[k], sharding, args.feed_seconds, clusters[k].pid(0)))
    scrape_ms = [] if scraper is None else scraper.durations_ms[1:]
  med = {k: {p: statistics.median(v) for p, v in r.items()} for k, r in results.items()}
  spread = lambda k, p: f"{min(results[k][p]):.0f}..{max(results[k][p]):.0f}"
  # Ratios paired within a round (measured back to back), then their median: slow
  # drift of the machine's load cancels.
  paired = lambda k, p: statistics.median(a / b for a, b in zip(results[k][p], results["off"][p]))
  print(f"\n{args.rounds} rounds, the three clusters in rotating order; medians over the "
        "rounds (min..max); ratios: median of the per-round ratios\n")
  rows = []
  for p, what in (("call", "ctl.call round trip, p50 us"),
                  ("feed", f"ctl.feed batches/s (batch {BATCH})")):
    rows.append((what, f"{med['off'][p]:.0f} ({spread('off', p)})",
                 f"{med['off again'][p]:.0f} ({spread('off again', p)})",
                 f"{med['on'][p]:.0f} ({spread('on', p)})",
                 f"{paired('off again', p):.3f}", f"{paired('on', p):.3f}"))
  per = {k: {p: v[0] / max(v[1], 1) * 1e6 for p, v in c.items()} for k, c in cpu.items()}
  for p, what in (("call", "sidecar CPU per call, us"), ("feed", "sidecar CPU per batch, us")):
    rows.append((what, f"{per['off'][p]:.0f}", f"{per['off again'][p]:.0f}", f"{per['on'][p]:.0f}",
                 f"{per['off again'][p] / per['off'][p]:.3f}",
                 f"{per['on'][p] / per['off'][p]:.3f}"))
  scraped = f"scraped every {args.scrape_period:g} s" if url else "not scraped"
  print(table(("path", "metrics off", "off again (A/A)", f"metrics on, {scraped}",
               "A/A ratio", "on / off"), rows))
  cost = recorder_us()
  print(f"\nmetrics code per call on the sidecar: {cost:.2f} us = "
        f"{cost / med['off']['call']:.2%} of the call round trip; per feed batch: none "
        "(feed figures are read at scrape time)")
  if scrape_ms:
    print(f"one scrape of /metrics (HTTP GET + parse, client side): median "
          f"{statistics.median(scrape_ms):.1f} ms, max {max(scrape_ms):.1f} ms")


def dashboard_run(args, cluster, sharding, tmp: str) -> list[tuple[float, dict]]:
  """A feed, calls and a save every few seconds, scraped twice a second."""
  state = {"w": jax.device_put(np.ones(args.state_mib << 18, np.float32), sharding)}
  with cluster.controller() as ctl, ctl.checkpointer(tmp, max_to_keep=2) as ckpt, Scraper(
      cluster.metrics_urls[0], 0.5) as scraper, ctl.feed(
          "bench_small", global_batch_size=BATCH, sharding=sharding,
          options=sidecar.FeedOptions(prefetch=4)) as feed:
    t0, step, next_save = time.monotonic(), 0, 2.0
    while time.monotonic() - t0 < args.dashboard_seconds:
      jax.block_until_ready(next(feed))
      ctl.call("bench_echo", args=(1,))
      time.sleep(0.002)  # a "training step"
      if time.monotonic() - t0 >= next_save:
        step += 1
        ckpt.save(step, state)
        next_save += args.save_every
    ckpt.wait()
    time.sleep(1.0)
  return scraper.samples


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--calls", type=int, default=500)
  p.add_argument("--feed-seconds", type=float, default=1.5)
  p.add_argument("--dashboard-seconds", type=float, default=24.0)
  p.add_argument("--save-every", type=float, default=5.0)
  p.add_argument("--state-mib", type=int, default=128)
  p.add_argument("--scrape-period", type=float, default=1.0,
                 help="seconds between scrapes of the metrics cluster (0: none)")
  p.add_argument("--png", help="draw the dashboard's panels from the run into this file")
  args = p.parse_args()
  import tempfile
  kw = dict(num_hosts=1, devices_per_host=1, shm_size="1GiB", imports=FNS)
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  # The metrics cluster starts between the two others: where a cluster starts is no favour.
  with sidecar.testing.LocalCluster(**kw) as off, sidecar.testing.LocalCluster(
      **kw, metrics=True, configure_jax=False) as on, sidecar.testing.LocalCluster(
      **kw, configure_jax=False) as off_again:
    overhead(args, {"off": off, "off again": off_again, "on": on}, sharding)
    if args.png:
      with tempfile.TemporaryDirectory() as tmp:
        samples = dashboard_run(args, on, sharding, tmp + "/ck")
      from benchmarks import metrics_plot
      metrics_plot.draw(samples, args.png)
      print(f"\npanels drawn from {len(samples)} scrapes: {args.png}")


if __name__ == "__main__":
  main()
