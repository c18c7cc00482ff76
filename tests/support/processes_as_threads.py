"""Trainer processes of one job stood for by threads of the test's process."""

import threading
from collections.abc import Callable
from typing import Any


def run_as_processes(count: int, body: Callable[[int], Any]) -> list[Any]:
  """Runs ``body(p)`` for processes ``0 .. count-1`` at once, on threads; returns each one's
  result, or the exception it raised (the test looks at it)."""
  outcomes: list[Any] = [None] * count

  def one(p: int) -> None:
    try:
      outcomes[p] = body(p)
    except Exception as e:
      outcomes[p] = e
  threads = [threading.Thread(target=one, args=(p,)) for p in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  return outcomes
