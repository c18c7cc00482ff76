"""A child's output relayed line by line, each line prefixed (``sidecar launch``'s trainers)."""

from __future__ import annotations

import threading
from typing import BinaryIO

READ_CHUNK = 1 << 16


def pump(pipe: BinaryIO, prefix: bytes, out: BinaryIO, lock: threading.Lock) -> None:
  """Copies ``pipe`` to ``out`` line by line, each line prefixed; ends a partial last line.

  A chunk that ends mid-line (a line longer than a chunk, or the last one) is held until
  the next read: the last line and its added newline go out in one write, so another
  trainer's line never lands between them.
  """
  at_start, held = True, b""
  with pipe:
    for chunk in iter(lambda: pipe.readline(READ_CHUNK), b""):
      if held:  # more of its line came: it was not the last
        write(out, held, lock)
      data = prefix + chunk if at_start else chunk
      at_start = chunk.endswith(b"\n")
      held = b"" if at_start else data
      if at_start:
        write(out, data, lock)
  if held:
    write(out, held + b"\n", lock)


def write(out: BinaryIO, data: bytes, lock: threading.Lock) -> None:
  with lock:
    try:
      out.write(data)
      out.flush()
    except (OSError, ValueError):
      pass  # Our stdout is gone; keep draining so the trainer never blocks on a full pipe.
