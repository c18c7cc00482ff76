"""Draws the panels of ``k8s/grafana/sidecar-dashboard.json`` from scrapes of a run.

Each panel computes what its PromQL query does (``rate`` over a short window,
``histogram_quantile`` over the bucket deltas), from the samples the benchmark took.
"""

from __future__ import annotations

import math

WINDOW_S = 2.0  # the rate() window: short, as the run is


def _series(samples, metric: str, /, **labels: str) -> list[float]:
  """Per scrape, the sum of ``name`` over the series whose labels include ``labels``."""
  want = set(labels.items())
  return [sum(v for (n, ls), v in s.items() if n == metric and want <= set(ls))
          for _, s in samples]


def _rate(times: list[float], values: list[float]) -> tuple[list[float], list[float]]:
  out_t, out_v, j = [], [], 0
  for i, t in enumerate(times):
    while times[j] < t - WINDOW_S:
      j += 1
    if i > j:
      out_t.append(t)
      out_v.append((values[i] - values[j]) / (t - times[j]))
  return out_t, out_v


def _quantile(q: float, samples, metric: str, times: list[float], /, **labels: str):
  """``histogram_quantile(q, rate(name_bucket[WINDOW]))``, as Prometheus interpolates."""
  bounds = sorted({float(dict(ls)["le"]) for (n, ls) in samples[-1][1]
                   if n == f"{metric}_bucket" and set(labels.items()) <= set(ls)})
  cumulative = {b: _series(samples, f"{metric}_bucket", le=_le(b), **labels) for b in bounds}
  out_t, out_v, j = [], [], 0
  for i, t in enumerate(times):
    while times[j] < t - WINDOW_S:
      j += 1
    if i <= j:
      continue
    counts = [cumulative[b][i] - cumulative[b][j] for b in bounds]
    if not counts or counts[-1] <= 0:  # no calls in the window: a gap, as in Grafana
      out_t.append(t)
      out_v.append(math.nan)
      continue
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for b, c in zip(bounds, counts):
      if c >= rank:
        upper = b if math.isfinite(b) else lower
        out_t.append(t)
        out_v.append(lower + (upper - lower) * (rank - below) / max(c - below, 1e-12))
        break
      lower, below = b, c
  return out_t, out_v


def _le(b: float) -> str:
  return "+Inf" if math.isinf(b) else repr(b)


def draw(samples, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  t0 = samples[0][0]
  times = [t - t0 for t, _ in samples]
  fig, axes = plt.subplots(3, 2, figsize=(13, 10), constrained_layout=True)
  fig.suptitle("colocated-sidecar: one host's /metrics during a benchmark run "
               "(panels of k8s/grafana/sidecar-dashboard.json)")

  ax = axes[0][0]
  ax.plot(*_rate(times, _series(samples, "sidecar_feed_batches_total")), label="all pipelines")
  ax.set_title("Feed batches/s  rate(sidecar_feed_batches_total)")

  ax = axes[0][1]
  for what in ("produce", "backpressure", "trainer_wait"):
    ax.plot(*_rate(times, _series(samples, f"sidecar_feed_{what}_seconds_total")), label=what)
  ax.set_title("Feed time, s per s  rate(sidecar_feed_*_seconds_total)")

  ax = axes[1][0]
  for name in ("bench_echo", "sidecar.ckpt.stage", "sidecar.ckpt.commit"):
    for q in (0.5, 0.99):
      t, v = _quantile(q, samples, "sidecar_call_seconds", times, name=name)
      ax.plot(t, [x * 1e3 for x in v], label=f"{name} p{int(q * 100)}")
  ax.set_yscale("log")
  ax.set_title("Call latency, ms  histogram_quantile(sidecar_call_seconds_bucket)")

  ax = axes[1][1]
  gib = 1 / (1 << 30)
  for name, label, style in (("sidecar_arena_used_bytes", "used", "-"),
                             ("sidecar_arena_leased_bytes", "leased to workers", "--"),
                             ("sidecar_arena_pinned_bytes", "held by the sidecar", ":")):
    ax.plot(times, [v * gib for v in _series(samples, name)], style, label=label, lw=2)
  ax.axhline(_series(samples, "sidecar_arena_size_bytes")[-1] * gib, color="grey", ls="--",
             label="size")
  ax.set_title("Arena, GiB")

  ax = axes[2][0]
  for what, style in (("staged", "-"), ("written", "--"), ("replicated", ":")):
    t, v = _rate(times, _series(samples, "sidecar_checkpoint_bytes_total", what=what))
    ax.plot(t, [x / 1e9 for x in v], style, label=what)
  ax.set_title("Checkpoint GB/s  rate(sidecar_checkpoint_bytes_total)")

  ax = axes[2][1]
  ax.step(times, _series(samples, "sidecar_ram_tier_steps", kind="own"), where="post",
          label="RAM-tier steps")
  ax.step(times, _series(samples, "sidecar_checkpoint_writing_steps"), where="post",
          label="steps being written")
  ax2 = ax.twinx()
  ax2.plot(times, [v * gib for v in _series(samples, "sidecar_ram_tier_bytes", kind="own")],
           color="tab:red", label="RAM-tier GiB")
  ax2.set_ylabel("GiB")
  ax2.legend(loc="upper right")
  ax.set_title("RAM tier and writes")

  for row in axes:
    for ax in row:
      ax.set_xlabel("s")
      ax.grid(alpha=0.3)
      ax.legend(loc="upper left", fontsize=8)
  fig.savefig(path, dpi=80)
