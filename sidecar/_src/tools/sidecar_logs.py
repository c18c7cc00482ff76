"""The sidecars' logs of ``sidecar launch`` and ``sidecar local``: kept, and their warnings
shown where the user looks.

Each run keeps its sidecars' whole output in a directory of its own, ``BASE/RUN_ID/host<i>.log``
(:func:`run_dir`; BASE is ``--log-dir``, else ``$SIDECAR_LOG_DIR``, else ``./sidecar-logs``),
which outlives the run, and a :class:`Follower` thread passes on, as they are written, each
sidecar's WARNING, ERROR and CRITICAL records (the lines that continue one, a traceback,
with it) and the tracebacks Python prints by itself (an uncaught exception in a thread, a
fatal error), each line prefixed ``[sidecar i] ``. Both log formats are read: text
(``core/logs.TEXT_FORMAT``) and JSON (one object a line, its ``level`` field).

Example::

  follower = Follower({0: cluster.log_path(0)}, print)
  follower.start()
  ...
  follower.close()  # what was written until now is shown, then its thread ends
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
from collections.abc import Callable, Mapping

from sidecar._src.core import env as env_lib, errors

DEFAULT_BASE = "sidecar-logs"
SHOWN_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
POLL_S = 0.1
_READ = 1 << 20
# core/logs.TEXT_FORMAT's start: "2026-12-01 11:42:07,123 WARNING name: message".
_TEXT_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) ")
# What Python prints without logging: each begins a block shown whole.
_RAW_STARTS = ("Traceback (most recent call last)", "Exception in thread", "Fatal Python error")


def base_dir(flag: str | None) -> str:
  """Where runs keep their logs: ``flag`` (``--log-dir``), else ``$SIDECAR_LOG_DIR``, else
  ``./sidecar-logs``, as an absolute path."""
  return os.path.abspath(flag or env_lib.get(env_lib.LOG_DIR) or DEFAULT_BASE)


def run_dir(base: str) -> str:
  """A new directory for one run's logs in ``base`` (made, with its parents), named for
  the run's start and this process: ``base/20261201-114207-4242``.

  Raises:
    InvalidArgumentError: it cannot be made there (a file in the way, no permission).
  """
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  name, n = f"{stamp}-{os.getpid()}", 1
  try:
    os.makedirs(base, exist_ok=True)
    while True:
      path = os.path.join(base, name)
      try:
        os.mkdir(path, 0o700)
        return path
      except FileExistsError:  # a second run of this process within the second
        n += 1
        name = f"{stamp}-{os.getpid()}-{n}"
  except OSError as e:
    raise errors.InvalidArgumentError(
        f"cannot keep the sidecars' logs in {base!r}: {e.strerror or e}; give --log-dir (or "
        f"${env_lib.LOG_DIR}) a directory you may write") from e


def level_of(line: str) -> str | None:
  """The level of the log record that ``line`` begins, or None where it begins none."""
  m = _TEXT_LOG_LINE.match(line)
  if m:
    return m.group(1)
  if line.startswith("{"):
    try:
      record = json.loads(line)
    except ValueError:
      return None
    level = record.get("level") if isinstance(record, dict) else None
    return level if isinstance(level, str) else None
  return None


class Lines:
  """Which of one log's lines to show, read in pieces of any size: a record at a shown
  level and the lines that continue it; a traceback Python printed itself."""

  def __init__(self) -> None:
    self._partial = b""
    self._showing = False

  def feed(self, data: bytes) -> list[str]:
    """The lines to show among ``data``'s complete ones (a partial last line waits)."""
    *whole, self._partial = (self._partial + data).split(b"\n")
    return [line for line in map(_text, whole) if self._shown(line)]

  def end(self) -> list[str]:
    """The partial last line, if shown: the log ends there."""
    partial, self._partial = _text(self._partial), b""
    return [partial] if partial and self._shown(partial) else []

  def _shown(self, line: str) -> bool:
    level = level_of(line)
    if level is not None:
      self._showing = level in SHOWN_LEVELS
    elif line.startswith(_RAW_STARTS):
      self._showing = True
    return self._showing


def _text(line: bytes) -> str:
  return line.decode(errors="replace").rstrip("\r")


class Follower:
  """Shows the lines :class:`Lines` picks from each sidecar's log as they are written, each
  through ``write`` as ``[sidecar i] LINE``. Owns one thread and the files it holds open:
  a log removed meanwhile (a LocalCluster's own directory at close) is still read to its end.
  """

  def __init__(self, paths: Mapping[int, str], write: Callable[[str], None], *,
               interval: float = POLL_S):
    self._paths = dict(paths)
    self._write = write
    self._interval = interval
    self._files: dict[int, int] = {}  # host -> descriptor, opened once the file exists
    self._lines = {h: Lines() for h in self._paths}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> Follower:
    if self._thread is None:
      self._open()  # now, so that a log removed before the first read is still read
      self._thread = threading.Thread(target=self._run, name="sidecar-logs", daemon=True)
      self._thread.start()
    return self

  def close(self) -> None:
    """Shows what the logs hold until now, then ends the thread and closes the files;
    idempotent."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
      self._read()
      for h, lines in self._lines.items():
        for line in lines.end():
          self._write(f"[sidecar {h}] {line}")
    for fd in self._files.values():
      os.close(fd)
    self._files.clear()

  def __enter__(self) -> Follower:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  def _run(self) -> None:
    while not self._stop.wait(self._interval):
      self._read()

  def _open(self) -> None:
    for h, path in self._paths.items():
      if h not in self._files:
        try:
          self._files[h] = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
          pass  # not made yet: the next read tries again

  def _read(self) -> None:
    self._open()
    for h, fd in self._files.items():
      while data := os.read(fd, _READ):
        for line in self._lines[h].feed(data):
          self._write(f"[sidecar {h}] {line}")
