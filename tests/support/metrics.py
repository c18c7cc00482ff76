"""Reading a sidecar's /metrics: its samples by name and labels."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from sidecar._src.server import metrics as metrics_lib


def snapshot(**kw) -> metrics_lib.Snapshot:
  """A sidecar's scrape-time figures, with ``kw`` in place of the defaults."""
  base = dict(host_id=0, slice_id=0, uptime_s=1.0, arena_size=1 << 20, arena_used=4096,
              arena_blocks=1, leased=(("0123456789ab", 4096),), pinned_bytes=0, workers=1,
              feeds=(metrics_lib.FeedTotals("ids", 1, 5, 0.5, 0.25, 0.125),), ram_steps=2,
              ram_bytes=100, replica_steps=1, replica_bytes=50, writing_steps=0,
              writing_bytes=0)
  return metrics_lib.Snapshot(**{**base, **kw})


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
  """Every sample of an exposition, by (name, sorted labels)."""
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, metric: str, /, **labels: str) -> float:
  return found.get((metric, tuple(sorted(labels.items()))), 0.0)


def total(found: dict, metric: str, /, **labels: str) -> float:
  """The sum over every series of ``name`` whose labels include ``labels``."""
  return sum(v for (n, ls), v in found.items()
             if n == metric and set(labels.items()) <= set(ls))


def scrape(url: str) -> str:
  with urllib.request.urlopen(url, timeout=10) as response:
    assert response.status == 200
    return response.read().decode()
