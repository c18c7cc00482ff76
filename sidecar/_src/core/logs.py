"""How the ``sidecar`` command logs: human-readable lines, or one JSON object a line.

``--log-format json`` (``SIDECAR_LOG_FORMAT=json``) writes, per record::

  {"time": "2026-12-01T11:42:07.123Z", "level": "INFO",
   "logger": "sidecar._src.server.checkpoint.checkpoints",
   "message": "step 3: wrote 1.0 GiB in 0.61 s (1.76 GB/s)", "host_id": 0, "step": 3}

with ``host_id`` on every record of a sidecar, and ``session`` / ``step`` where the
record is about one (passed as ``extra={"step": ...}``), and ``exception`` with the
traceback where there is one. A log shipper (Fluent Bit, Cloud Logging) reads it as is.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

TEXT = "text"
JSON = "json"
FORMATS = (TEXT, JSON)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Record attributes copied into the JSON object when a log call passes them as ``extra``.
CONTEXT_KEYS = ("host_id", "session", "step")


class JsonFormatter(logging.Formatter):
  """One JSON object per log entry (a ``logging.LogRecord``); ``context`` (e.g.
  ``host_id``) is on every one."""

  def __init__(self, **context: Any):
    super().__init__()
    self._context = context

  def format(self, entry: logging.LogRecord) -> str:
    seconds = time.gmtime(entry.created)
    out: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{int(entry.msecs):03d}Z",
        "level": entry.levelname, "logger": entry.name, "message": entry.getMessage()}
    out.update(self._context)
    for key in CONTEXT_KEYS:
      value = getattr(entry, key, None)
      if value is not None:
        out[key] = value
    if entry.exc_info:
      out["exception"] = self.formatException(entry.exc_info)
    elif entry.stack_info:
      out["stack"] = self.formatStack(entry.stack_info)
    return json.dumps(out, default=str)


def configure(fmt: str = TEXT, level: str | int = "INFO", **context: Any) -> None:
  """Sends the root logger's records to stderr in ``fmt`` ("text" or "json").

  Raises:
    ValueError: ``fmt`` is neither.
  """
  if fmt not in FORMATS:
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
  # force: importing Orbax lets absl configure the root logger at WARNING first.
  logging.basicConfig(level=level, force=True, format=TEXT_FORMAT)
  if fmt == JSON:
    for handler in logging.getLogger().handlers:
      handler.setFormatter(JsonFormatter(**context))
