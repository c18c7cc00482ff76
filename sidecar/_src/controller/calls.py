"""Unary calls of registered functions: encode, send within a CallWindow, decode.

Large array arguments go through the host's arena when this process maps it (its
Worker), inline otherwise; ``held`` keeps their blocks until the call ends.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from sidecar._src.arena import worker as worker_lib
from sidecar._src.controller import interrupts
from sidecar._src.controller.connection import Connection
from sidecar._src.core import errors
from sidecar._src.wire import codec, protocol
from sidecar._src.wire.protocol import pb


class Calls:
  """Runs registered functions on sidecars, through one controller's connections.

  Args:
    connection: the Connection to a host id.
    worker: the Worker that maps a host id's arena here, or None.
  """

  def __init__(self, *, connection: Callable[[int], Connection],
               worker: Callable[[int], worker_lib.Worker | None]):
    self._connection = connection
    self._worker = worker

  def request(self, host_id: int, name: str, args: tuple, kwargs: dict, timeout: float,
              held: list) -> pb.CallRequest:
    """The request for ``name(*args, **kwargs)`` on ``host_id``; arena blocks go in ``held``."""
    if not isinstance(name, str):
      raise errors.InvalidArgumentError(f"name must be a str, got {name!r}")
    w = self._worker(host_id)
    to_arena = None
    if w is not None:
      def to_arena(a):
        ref = w.ref_of(a)
        if ref is not None:  # already in the arena: send the descriptor only
          held.append(a)
          return ref
        dst, ref = w.put(a, timeout=timeout)
        held.append(dst)  # This side holds argument blocks until the call ends.
        return ref
    return pb.CallRequest(
        name=name, args=codec.encode(tuple(args), to_arena=to_arena, where="args"),
        kwargs=codec.encode(dict(kwargs), to_arena=to_arena, where="kwargs"),
        worker_session=w.session if w is not None else "")

  def decode(self, host_id: int, name: str, response: pb.CallResponse) -> Any:
    w = self._worker(host_id)
    return codec.decode(response.result, from_arena=w.view if w else None,
                        where=f"result of {name!r} from host {host_id}")

  def call_sync(self, host_id: int, name: str, args: tuple, kwargs: dict,
                timeout: float) -> Any:
    """Runs ``name`` on ``host_id`` on this thread; Ctrl-C leaves it running."""
    conn, held = self._connection(host_id), []
    deadline = time.monotonic() + timeout
    request = self.request(host_id, name, args, kwargs, timeout, held)
    try:
      entered = conn.calls.enter(deadline - time.monotonic())
    except BaseException:  # closed, or Ctrl-C: the arguments' blocks go back now
      held.clear()
      raise
    if not entered:
      held.clear()
      raise conn.calls.waited_too_long(f"call {name!r} on host {host_id}", timeout)
    leave = True  # give the window's slot back here (not when a call outlives Ctrl-C)
    try:
      left = max(deadline - time.monotonic(), 0.0)
      if threading.current_thread() is not threading.main_thread():
        response = conn.call_rpc(request, timeout=left, metadata=conn.metadata)
      else:  # a future, which Ctrl-C can leave; a blocking call would hold it off to the end
        rpc = conn.call_rpc.future(request, timeout=left, metadata=conn.metadata)
        try:
          response = interrupts.wait(rpc)
        except KeyboardInterrupt:
          # The call goes on (within its deadline), holding its arguments' blocks; what
          # it returns is dropped then, so its result's blocks go back too.
          kept, leave = list(held), False
          rpc.add_done_callback(lambda f: self._drop(host_id, name, f, kept, conn))
          raise
    except grpc.RpcError as e:
      error = protocol.error_from_rpc(e, host=conn.address, host_id=host_id)
      if not isinstance(error, errors.SessionLostError):
        raise error from None
      conn.renew()  # the sidecar lost our session (a flood evicted it): once more, anew
      left = max(deadline - time.monotonic(), 0.0)
      try:
        response = conn.call_rpc(request, timeout=left, metadata=conn.metadata)
      except grpc.RpcError as e2:
        raise protocol.error_from_rpc(e2, host=conn.address, host_id=host_id) from None
    except ValueError:
      if conn.calls.closed:  # gRPC's "Channel closed!": the controller closed meanwhile
        raise errors.ClosedError(f"call {name!r} on host {host_id}: the connection "
                                 "closed") from None
      raise
    finally:
      held.clear()
      if leave:
        conn.calls.exit()
    return self.decode(host_id, name, response)

  def _drop(self, host_id: int, name: str, rpc: grpc.Future, held: list,
            conn: Connection) -> None:
    """Decodes and drops the result of a call nobody waits for: its blocks go back."""
    conn.calls.exit()
    held.clear()
    try:
      self.decode(host_id, name, rpc.result())
    except Exception:  # the caller is gone; its error has nobody to reach
      pass

  def call_future(self, host_id: int, name: str, args: tuple, kwargs: dict,
                  timeout: float) -> concurrent.futures.Future:
    """Runs ``name`` on ``host_id``; its result (or error) in a Future."""
    conn, held = self._connection(host_id), []
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
      request = self.request(host_id, name, args, kwargs, timeout, held)
    except Exception as e:
      out.set_exception(e)
      return out

    deadline = time.monotonic() + timeout
    renewed = [False]

    def done(f: grpc.Future) -> None:
      try:
        out.set_result(self.decode(host_id, name, f.result()))
      except grpc.RpcError as e:
        error = protocol.error_from_rpc(e, host=conn.address, host_id=host_id)
        if isinstance(error, errors.SessionLostError) and not renewed[0]:
          renewed[0] = True  # the sidecar lost our session: once more, anew, off gRPC's thread
          threading.Thread(target=again, name="sidecar-renew", daemon=True).start()
          return
        out.set_exception(error)
      except Exception as e:
        out.set_exception(e)
      held.clear()

    def fail(e: BaseException) -> None:
      held.clear()
      out.set_exception(e)

    def send() -> None:
      conn.calls.call(  # the wait for a slot counts toward the timeout
          lambda left: conn.call_rpc.future(request, timeout=left, metadata=conn.metadata),
          done=done, fail=fail, timeout=deadline - time.monotonic(),
          what=f"call {name!r} on host {host_id}")

    def again() -> None:
      try:
        conn.renew()
      except Exception as e:
        fail(e)
        return
      send()

    send()
    return out
