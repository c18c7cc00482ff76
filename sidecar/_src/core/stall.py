"""The stall rule: how long a trainer may go without a step before it counts as hung.

One rule for every place that watches (the sidecar's ``server/goodput/steps.py``, which applies it
to each worker session; ``sidecar launch --stall-timeout`` and ``sidecar serve
--stall-timeout``, which set its floor; docs/elastic.md): a trainer that made its first
step is **stalled** once it has made no step for :func:`timeout` seconds, the larger of
the floor and :data:`MULTIPLE` times the slowest step seen since its first. A slow step
seen once (a save, an evaluation, a recompile) so never trips it later, and the first
step (the compile) is never watched. A floor of 0 turns it off.
"""

from __future__ import annotations

DEFAULT_FLOOR_S = 120.0  # sidecar launch's and sidecar serve's --stall-timeout
MULTIPLE = 10.0  # a stall lasts at least this many times the slowest step seen
EXIT_CODE = 124  # sidecar launch's exit code for a stall it may not restart (as timeout(1))

RULE = (f"no step (a feed's batches taken, a save) for the larger of SECONDS and "
        f"{MULTIPLE:g}x the slowest step seen, after its first step")


def timeout(floor_s: float, slowest_s: float) -> float:
  """Seconds without a step after which a trainer is stalled (0: never)."""
  return 0.0 if floor_s <= 0 else max(floor_s, MULTIPLE * slowest_s)


def check_floor(value: float) -> float:
  """``value`` as a floor, checked.

  Raises:
    ValueError: not finite seconds >= 0.
  """
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      0 <= value < float("inf")):
    raise ValueError(f"the stall timeout must be seconds >= 0 (0: off), got {value!r}")
  return float(value)
