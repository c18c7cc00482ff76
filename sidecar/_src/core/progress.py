"""Progress bars on long waits: tqdm (``tqdm.auto`` in a notebook), quiet elsewhere.

A bar shows only when its output is a terminal or a notebook, and only once the
wait has lasted ``delay`` seconds; a short wait prints nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)
SAY_AFTER_S = 1.0  # a wait in a pool's admission queue this long is said in a warning


def in_notebook() -> bool:
  """Whether this process is a Jupyter kernel."""
  shell = sys.modules.get("IPython")
  get = getattr(shell, "get_ipython", None)
  return get is not None and type(get()).__name__ == "ZMQInteractiveShell"


def enabled() -> bool:
  """Whether a bar would be seen: a notebook, or stderr is a terminal."""
  try:
    return in_notebook() or sys.stderr.isatty()
  except (AttributeError, ValueError):  # stderr replaced or closed
    return False


def _tqdm() -> Any:
  if in_notebook():
    try:
      import ipywidgets  # noqa: F401  (tqdm.auto's widget needs it)
      from tqdm.auto import tqdm
      return tqdm
    except ImportError:
      pass
  from tqdm import tqdm as std
  return std


@contextlib.contextmanager
def lines(progress: Callable[[str], None] | None | bool, what: str = ""
          ) -> Iterator[Callable[[str], None] | None]:
  """The ``progress`` a long wait reports its lines to: the caller's callable as it is;
  ``None`` (the default): a one-line tqdm status when enabled, else nothing; ``False``:
  nothing."""
  if progress is False or (progress is None and not enabled()):
    yield None
    return
  if progress is not None and progress is not True:
    yield progress
    return
  bar = _tqdm()(total=None, bar_format="{desc} [{elapsed}]", desc=what, leave=False,
                file=sys.stderr, delay=1.0)  # nothing for a wait under a second
  try:
    yield bar.set_description_str
  finally:
    bar.close()


@contextlib.contextmanager
def waiting(what: str, *, delay: float = 2.0) -> Iterator[None]:
  """Shows ``what`` with the time waited, once the block has lasted ``delay`` seconds."""
  if not enabled():
    yield
    return
  stop = threading.Event()

  def show() -> None:
    if stop.wait(delay):
      return
    bar = _tqdm()(total=None, bar_format="{desc} [{elapsed}]", desc=what, leave=False,
                  file=sys.stderr)
    bar.start_t -= delay  # the wait began before the bar
    try:
      while not stop.wait(0.5):
        bar.refresh()
    finally:
      bar.close()

  thread = threading.Thread(target=show, name="sidecar-progress", daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join(5)


def bar(text: str) -> Any:
  """A one-line tqdm status of ``text`` with the time elapsed (call where :func:`enabled`);
  its ``set_description_str`` redraws it, ``close`` ends it."""
  return _tqdm()(total=None, bar_format="{desc} [{elapsed}]", desc=text, leave=False,
                 file=sys.stderr)


class Queued:
  """A request waiting in a pool's admission queue: its tenant, place and estimate, and
  how long it may wait (``limit_s``; None: as long as its turn takes), redrawn on a tqdm
  line as the sidecar reports them where one is seen, and said once in a warning
  wherever (a script's stderr, a log) once it has lasted :data:`SAY_AFTER_S` (the
  sidecar reports every second), so no wait for arena room is silent.
  ``close()`` is idempotent."""

  def __init__(self, what: str, limit_s: float | None = None):
    self._what, self._limit = what, limit_s
    self._started = time.monotonic()
    self._bar: Any = None
    self._said = False

  def update(self, place: dict[str, Any]) -> None:
    """Shows ``place`` (``admission.Place.to_dict()``: tenant, position, waiting, eta_s)."""
    eta = place.get("eta_s")
    waited = time.monotonic() - self._started
    limit = ("it waits as long as its turn takes" if self._limit is None else
             f"it gives up in {max(self._limit - waited, 0.0):.0f} s (its timeout, "
             f"{self._limit:.3g} s)")
    text = (f"{self._what}: tenant {place.get('tenant')!r} waits in the sidecar's arena "
            f"queue, {place.get('position')} of {place.get('waiting')}, "
            + ("no estimate yet" if eta is None else f"about {float(eta):.0f} s left")
            + f"; {limit}")
    if not self._said and waited >= SAY_AFTER_S:  # a wait of a moment is no news
      self._said = True
      log.warning("%s (docs/pool.md, Admission)", text)
    if not enabled():
      return
    if self._bar is None:
      self._bar = bar(text)
    else:
      self._bar.set_description_str(text)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def queued(what: str, limit_s: float | None = None) -> Queued:
  """A :class:`Queued` line for ``what`` (e.g. ``"arena block"``), that may wait
  ``limit_s`` seconds (None: as long as its turn takes)."""
  return Queued(what, limit_s)
