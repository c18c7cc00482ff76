"""The one table of ``benchmarks.accelerator``: rows with their baselines, and its outputs."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from benchmarks.common import table

UNITS = {"s": "{:.3f} s", "ms": "{:.2f} ms", "batches/s": "{:,.0f} batches/s",
         "steps/s": "{:,.1f} steps/s", "%": "{:.0%} of idle"}


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
  """One measured figure, its ratios to the baselines measured in the same run, and the
  issue's target where it has one (``met``: None where there is none)."""
  section: str
  what: str
  value: float | bool | None  # None: failed (``note`` says why); a bool: a check
  unit: str  # a key of UNITS, or "check"
  vs: tuple[tuple[str, float], ...] = ()  # (what the ratio means, ratio)
  target: str = ""
  met: bool | None = None
  note: str = ""

  def shown(self) -> str:
    if self.value is None:
      return "failed"
    if self.unit == "check":
      return "yes" if self.value else "NO"
    return UNITS[self.unit].format(self.value)

  def cells(self) -> tuple[str, ...]:
    vs = "; ".join(f"{r:.2f}x {label}" for label, r in self.vs) or "-"
    met = "-" if self.met is None else ("yes" if self.met else "NO")
    shown = self.shown() + (f" ({self.note})" if self.note else "")
    return (self.section, self.what, shown, vs, self.target or "-", met)


HEADER = ("part", "what", "measured", "ratio to its baseline (same run)", "target", "met")


def render(rows: list[Row]) -> str:
  return table(HEADER, [r.cells() for r in rows])


class Output:
  """The table as JSON and markdown under ``out_dir``, written again as each part ends (a
  run cut short still leaves what it measured). ``judge``: whether targets are judged
  (the issue's targets are the chip's; on a CPU, ``met`` is left empty)."""

  def __init__(self, out_dir: str, meta: dict, *, judge: bool, started: float):
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"accelerator-{meta['platform']}-"
                                 f"{time.strftime('%Y%m%d-%H%M%S')}")
    self.paths = (stem + ".json", stem + ".md")
    self.meta, self.judge, self.started = meta, judge, started

  def judged(self, rows: list[Row]) -> list[Row]:
    return rows if self.judge else [dataclasses.replace(r, met=None) for r in rows]

  def write(self, rows: list[Row]) -> None:
    rows = self.judged(rows)
    self.meta["took_s"] = time.perf_counter() - self.started
    with open(self.paths[0], "w") as f:
      json.dump({**self.meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    with open(self.paths[1], "w") as f:
      f.write(f"{headline(self.meta)}\n\n{render(rows)}\n")


def headline(meta: dict) -> str:
  return (f"`python -m benchmarks.accelerator {meta['argv']}` on {meta['device']} "
          f"({meta['platform']}), {meta['cores']} host cores, {meta['date']}: state "
          f"{meta['state']}, batch {meta['batch']}; the whole run took {meta['took_s']:.0f} s")
