"""Reading a sidecar's /metrics: its samples by name and labels."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


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
