"""Helpers shared by the benchmarks: timing loops and a plain table printer."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def rate(fn: Callable[[], object], *, seconds: float = 2.0, warmup: int = 3) -> tuple[float, int]:
  """Calls ``fn`` repeatedly for about ``seconds``; returns (calls per second, calls)."""
  for _ in range(warmup):
    fn()
  n, t0 = 0, time.perf_counter()
  while True:
    fn()
    n += 1
    elapsed = time.perf_counter() - t0
    if elapsed >= seconds and n >= 3:
      return n / elapsed, n


def latencies(fn: Callable[[], object], *, n: int = 2000, warmup: int = 100) -> list[float]:
  for _ in range(warmup):
    fn()
  out = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return sorted(out)


def pct(sorted_values: Sequence[float], p: float) -> float:
  return sorted_values[min(len(sorted_values) - 1, int(p / 100 * len(sorted_values)))]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)
