"""The main of a feed worker process (see ``pool.py``): fill batches until told to stop.

It runs JAX on the CPU, as the sidecar does: ``pool.py`` starts it with
``platform.sidecar_env``, and its main sets the same again before the pipeline's modules
(which may import JAX) load."""

from __future__ import annotations

import atexit
import base64
import os
import socket
import sys
import time
from collections.abc import Callable

from sidecar._src.arena import shm
from sidecar._src.core import platform
from sidecar._src.server.feeds import producer
from sidecar._src.user import data_roots, registry as registry_lib
from sidecar._src.wire import codec, ipc, protocol
from sidecar._src.wire.protocol import pb


def serve(sock: socket.socket, arena_fd: int,
          imported: Callable[[], None] | None = None) -> None:
  """Fills batches until the socket ends. ``imported``: called once the pipeline's modules
  are imported, before anything of the request's is read (a pool tenant's worker becomes
  its tenant's user there: ``tenant_procs/feed_worker.py``)."""
  hello, _ = ipc.recv(sock)
  try:
    registry_lib.load_modules(hello["imports"])
    if imported is not None:
      imported()
    entry = registry_lib.default_registry().get(registry_lib.PIPELINE, hello["name"])
    spec = producer.Spec.from_proto(pb.FeedSpec.FromString(base64.b64decode(hello["spec"])))
    kwargs = codec.decode(pb.Value.FromString(base64.b64decode(hello["kwargs"])))
    roots = data_roots.DataRoots.from_dict(hello["data_roots"])
    ds = producer.open_source(entry, kwargs, spec, 0, 0, roots)
    arena = shm.Arena.attach(arena_fd, int(hello["arena_size"]),
                             populate=bool(hello.get("arena_populate", True)))
  except Exception as e:
    ipc.send(sock, {"error": protocol.error_dict(e)})
    return
  ipc.send(sock, {"ready": True})
  # No allocator: every task brings its output arrays.
  batcher = producer.Batcher(spec, None, entry.name)  # type: ignore[arg-type]
  order = producer.Order(ds, spec.seed)
  while True:
    try:
      task, _ = ipc.recv(sock)
    except (ConnectionError, OSError):
      return  # the sidecar closed the pool, or died
    try:
      t0 = time.perf_counter()
      out = [[codec.as_array(arena.view(offset, arena.size - offset),
                             codec.ArenaRef(offset, 0, 0, dtype, tuple(shape)))
              for offset, shape, dtype in leaf] for leaf in task["blocks"]]
      batcher.write(out, order.rows(task["epoch"], task["position"], spec.ranges))
      reply = {"seq": task["seq"], "produce_s": time.perf_counter() - t0}
    except Exception as e:
      reply = {"seq": task["seq"], "error": protocol.error_dict(e)}
    try:
      ipc.send(sock, reply)
    except (ConnectionError, OSError):
      return  # the feed ended while this batch was made: nobody waits for it


def exit_now(code: int = 0) -> None:
  """Exits at once once the feed is over: the exit handlers run (multiprocessing's ends the
  pipeline's own children), the interpreter's teardown does not. Tearing down the modules
  of a pipeline that imported JAX and Grain takes ~0.2 s, and a restart's trainer waits for
  no leftover of the feed it replaces."""
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(code)


if __name__ == "__main__":
  platform.apply_to_sidecar()
  serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
  exit_now()
