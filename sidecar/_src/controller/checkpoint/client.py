"""The controller's side of the ``sidecar.v1.Checkpoint`` service: one call for a save's
values, one typed method for each other request.

:class:`CheckpointTransport` is what a
:class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer` talks to: each call
on one host, returning a ``concurrent.futures.Future`` of plain
values (``ckptfmt.records``' frozen types: a shard's ``ShardRecord``, a ``Manifest``). Two
implement it: :class:`CheckpointClient`, over each host's gRPC channel (made by the
Controller), and the in-process fake of the unit tests
(``tests/support/fake_sidecars.py``), which runs Checkpointer's logic with no
process at all.

The client routes to a host through the Controller's placement check (a lost host
raises HostLostError at once, an unknown one InvalidArgumentError), sends shards as
arena blocks where this process maps the host's arena (else inline), and turns a
failed RPC into its SidecarError (UNAVAILABLE: HostLostError), as ``Controller.call``.
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from sidecar._src.ckptfmt.records import (
  Held,
  Manifest,
  ReplicaTarget,
  Replicated,
  ShardId,
  ShardRecord,
  Staged,
)
from sidecar._src.ckptfmt.save_values import SaveValue, Stage
from sidecar._src.ckptfmt.tiers import Tier
from sidecar._src.controller.checkpoint import ram_drop
from sidecar._src.core import errors
from sidecar._src.wire import checkpoint_wire as wire, codec, protocol, save_wire
from sidecar._src.wire.protocol import ckpt_pb, pb

# ckptfmt/records' types (both halves'), named here as well.
__all__ = ["CheckpointClient", "CheckpointTransport", "FormatExtra", "Held", "Manifest",
           "ReplicaTarget", "Replicated", "ShardId", "ShardRecord", "Staged"]


# A format's extra: its own data on a host's Stage requests or on the Commit request
# (stock Orbax's layout has none: its leaves travel as ``leaves``): a frozen value of the
# format's own type (its ``ckptfmt.Format.stage_extra``/``commit_extra``), converted by
# ``wire/checkpoint_wire``'s ``STAGE_EXTRAS``/``COMMIT_EXTRAS`` (the wire's ``part``
# oneof). The client names no format.
FormatExtra = object


_RETRY_S = 0.05  # the first wait before asking a busy sidecar again; then 2x, 3x, ...


class _Call:
  """One checkpoint rpc to one host, asked again while the host is busy, until ``deadline``.

  Its callbacks are bound methods and nothing here refers back to them: no reference
  cycle holds the decoded result (a restored shard is an arena view, whose block must
  go back at the caller's last reference, not when the garbage collector runs).
  """

  def __init__(self, conn: Any, host: int, method: str, request: Any,
               decode: Callable[[Any], Any], held: list | None, deadline: float,
               retries: _Retries):
    self._conn, self._host, self._method, self._request = conn, host, method, request
    self._decode, self._held, self._deadline = decode, held, deadline
    self._retries = retries
    self._tries, self._renewed = 0, False
    self.out: concurrent.futures.Future = concurrent.futures.Future()

  def send(self) -> None:
    self._conn.checkpoint_calls.call(  # at most CHECKPOINT_CALLS_IN_FLIGHT at once; waits count
        self._start, done=self._done, fail=self.fail,
        timeout=self._deadline - time.monotonic(),
        what=f"checkpoint rpc {self._method} on host {self._host}")

  def run(self) -> None:
    """:meth:`send` where its caller waits for the answer at once: on this thread, a
    blocking call (no thread of gRPC's started to wait for the answer, none to hand it
    over: a Stage that begins its step, which ``save()`` waits for). On the main thread,
    which Ctrl-C must be able to leave, as :meth:`send`. A busy host is asked again as
    :meth:`send` does (``out`` then resolves later)."""
    if threading.current_thread() is threading.main_thread():
      self.send()
      return
    conn = self._conn
    try:
      answer = conn.checkpoint_calls.blocking(
          lambda left: _Answer(getattr(conn.checkpoint, self._method), self._request, left,
                               conn.metadata),
          timeout=self._deadline - time.monotonic(),
          what=f"checkpoint rpc {self._method} on host {self._host}")
    except Exception as e:  # no slot in time, closed, or not sent
      self.fail(e)
      return
    self._done(answer)

  def _start(self, left: float) -> grpc.Future:
    conn = self._conn
    return getattr(conn.checkpoint, self._method).future(self._request, timeout=left,
                                                         metadata=conn.metadata)

  def _done(self, f: grpc.Future | _Answer) -> None:
    try:
      self.out.set_result(self._decode(f.result()))
    except grpc.RpcError as e:
      error = protocol.error_from_rpc(e, host=self._conn.address, host_id=self._host)
      wait = _RETRY_S * (self._tries + 1)
      if isinstance(error, errors.BusyError) and time.monotonic() + wait < self._deadline:
        # The sidecar's checkpoint threads are taken by other controllers (and peers):
        # ask again shortly, within the deadline, rather than call a live copy lost.
        self._tries += 1
        self._retries.later(wait, self, self.send)
        return
      if isinstance(error, errors.SessionLostError) and not self._renewed:
        self._renewed = True  # the sidecar lost our session: once more, anew
        self._retries.later(0, self, self._again)
        return
      self.out.set_exception(error)
    except Exception as e:
      self.out.set_exception(e)
    if self._held is not None:
      self._held.clear()

  def _again(self) -> None:
    """Sends the call again on a renewed session (off the rpc's callback thread)."""
    try:
      self._conn.renew()
    except Exception as e:
      self.fail(e)
      return
    self.send()

  def fail(self, e: BaseException) -> None:
    """Ends the call with ``e`` (unless it ended)."""
    if self._held is not None:
      self._held.clear()
    try:
      self.out.set_exception(e)
    except concurrent.futures.InvalidStateError:
      pass



class _Answer:
  """A blocking call's answer as a finished future's ``result()`` gives it: the response,
  or the ``grpc.RpcError`` raised."""

  def __init__(self, method: Any, request: Any, timeout: float, metadata: Any):
    self._response: Any = None
    self._error: grpc.RpcError | None = None
    try:
      self._response = method(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
      self._error = e

  def result(self) -> Any:
    if self._error is not None:
      raise self._error
    return self._response


class _Retries:
  """The busy calls waiting to be sent again, each on a timer; ``close()`` cancels and
  joins them (their calls fail with ClosedError), so no timer outlives its client.

  A timer knows its call only by number: no cycle holds a call (and its result) once sent.
  """

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._waiting: dict[int, tuple[threading.Timer, _Call, Callable[[], None]]] = {}
    self._next = 0
    self._closed = False

  def later(self, wait: float, call: _Call, again: Callable[[], None]) -> None:
    """Runs ``again`` (``call``'s) in ``wait`` seconds, on a timer thread of its own."""
    with self._lock:
      if not self._closed:
        self._next += 1
        timer = threading.Timer(wait, self._fire, args=(self._next,))
        timer.name, timer.daemon = "sidecar-ckpt-retry", True
        self._waiting[self._next] = (timer, call, again)
        timer.start()
        return
    call.fail(errors.ClosedError("the checkpointer closed while a busy sidecar was asked again"))

  def _fire(self, number: int) -> None:
    with self._lock:
      entry = self._waiting.pop(number, None)
    if entry is not None:  # else closed meanwhile: close() fails the call
      entry[2]()

  def close(self) -> None:
    with self._lock:
      self._closed = True
      waiting, self._waiting = list(self._waiting.values()), {}
    for timer, call, _ in waiting:
      timer.cancel()
      if timer is not threading.current_thread():
        timer.join(5)
      call.fail(errors.ClosedError(
          "the checkpointer closed while a busy sidecar was to be asked again"))


class CheckpointTransport(abc.ABC):
  """The checkpoint calls on one host each; see the service in ``checkpoint.proto``."""

  def close(self) -> None:  # noqa: B027 - a transport with nothing to stop needs none
    """Stops what the transport runs in the background; idempotent."""

  @abc.abstractmethod
  def put(self, host: int, data: np.ndarray) -> np.ndarray:
    """``data`` copied into ``host``'s arena (as is, to travel inline, if not mapped)."""

  def empty_like(self, host: int, arrays: Sequence[Any]
                 ) -> list[tuple[np.ndarray, codec.ArenaRef | None]]:
    """Arrays shaped as ``arrays`` (arrays, or anything with their ``shape``, ``dtype``
    and ``nbytes``) in ``host``'s arena, with their ``ArenaRef``s, in one round trip
    (host memory, to travel inline, if the arena is not mapped here)."""
    return [(np.empty(a.shape, a.dtype), None) for a in arrays]

  def arena_size(self, host: int) -> int | None:
    """The size of ``host``'s arena where this process maps it (known, no rpc); else None."""
    del host
    return None

  @abc.abstractmethod
  def status(self, *, timeout: float | None = None) -> list[pb.StatusResponse]:
    """Every live sidecar's status (arena use, checkpoint tiers)."""

  @abc.abstractmethod
  def open(self, host: int, directory: str, *, ram_steps: int, ram_budget: int | None,
           sweep: bool, job: str = "", holder: str = "") -> concurrent.futures.Future:
    """Future of the committed steps, ascending. ``job``: the job that opens it (the
    sidecar holds the directory for it, refusing other live jobs); ``holder``: who opens
    it, as another job's refusal names it."""

  @abc.abstractmethod
  def send(self, host: int, value: SaveValue, *, timeout: float | None = None
           ) -> concurrent.futures.Future:
    """Future of ``host``'s answer to ``value``, one of a step's save's values
    (``ckptfmt/save_values``, whose docstring gives their order and what each answers),
    within ``timeout`` seconds (None: the transport's default). A :class:`Stage` with a
    ``begin`` begins the step there first: its call is waited for at once."""

  @abc.abstractmethod
  def delete(self, host: int, directory: str, step: int, *, set_aside: bool = False
             ) -> concurrent.futures.Future:
    """Future of None once the committed step is gone; with ``set_aside``, of where it
    was moved out of the directory's steps ("": it was gone already)."""

  @abc.abstractmethod
  def forget(self, host: int, directory: str, step: int) -> concurrent.futures.Future:
    """Future of None once ``host``'s RAM tier dropped the step."""

  def drop_ram_tier(self, host: int, directory: str) -> concurrent.futures.Future:
    """Future of the :class:`ram_drop.RamTierDrop` once ``host`` dropped the durable
    RAM-tier copies of ``directory`` (a transport with no RAM tier holds none)."""
    del host, directory
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(ram_drop.RamTierDrop())
    return done

  @abc.abstractmethod
  def replicate(self, host: int, final_dir: str, targets: Sequence[int], *,
                bandwidth: int | None, timeout: float) -> concurrent.futures.Future:
    """Future of a :class:`Replicated` once every replica target (another sidecar, by
    host id: ``host`` finds its address in its own ``--replica-hosts``) holds ``host``'s
    staged shards of ``final_dir``."""

  @abc.abstractmethod
  def held(self, host: int, directory: str, *, timeout: float | None = None
           ) -> concurrent.futures.Future:
    """Future of a :class:`Held`."""

  @abc.abstractmethod
  def info(self, host: int, final_dir: str, *, taken_over: bool = False
           ) -> concurrent.futures.Future:
    """Future of a :class:`Manifest`. ``taken_over``: ``host``'s part of a step the
    sidecars took over, from its RAM tier, durable or not (its shards' records, crc32c
    once written; the data position on the committer's host only)."""

  @abc.abstractmethod
  def read(self, host: int, final_dir: str, record: ShardRecord, *, tier: Tier,
           checked: bool = True, byte_range: tuple[int, int] | None = None,
           private: bool = False) -> concurrent.futures.Future:
    """Future of the array of the shard ``record`` describes (the step's manifest's
    record, as the save wrote it), or bytes ``byte_range=(offset, nbytes)`` of it, uint8.

    The sidecar checks the copy against the record: its dtype and shape, and, ``checked``,
    its crc32c (not: the caller checks it itself, or another part of it is checked).

    ``private``: an array on this process's mapping of the arena comes copy-on-write
    (``Worker.view``): what the caller writes never reaches the block, which may be the
    RAM-tier copy itself."""


class CheckpointClient(CheckpointTransport):
  """:class:`CheckpointTransport` over each host's gRPC channel; made by the Controller.

  Args:
    select: the Controller's placement check: ``[host]`` -> ``[host]``, or raises.
    connection: a live host's connection (``stub``, ``metadata``, ``address``).
    worker: the Worker mapping a host's arena here, or None.
    status: the Controller's ``status``.
    timeout: the default deadline of each RPC, seconds.
  """

  def __init__(self, *, select: Callable[[Sequence[int]], list[int]],
               connection: Callable[[int], Any], worker: Callable[[int], Any],
               status: Callable[..., list[pb.StatusResponse]], timeout: float):
    self._select, self._connection, self._worker = select, connection, worker
    self._status, self._timeout = status, timeout
    self._retries = _Retries()

  def close(self) -> None:
    """Cancels the busy retries waiting; their calls fail with ClosedError. Idempotent."""
    self._retries.close()

  def put(self, host: int, data: np.ndarray) -> np.ndarray:
    w = self._worker(host)
    return w.put(data)[0] if w is not None else np.array(data)

  def empty_like(self, host: int, arrays: Sequence[Any]
                 ) -> list[tuple[np.ndarray, codec.ArenaRef | None]]:
    w = self._worker(host)
    if w is None:
      return super().empty_like(host, arrays)
    return list(w.empty_like(arrays))

  def arena_size(self, host: int) -> int | None:
    w = self._worker(host)
    return w.arena.size if w is not None else None

  def status(self, *, timeout: float | None = None) -> list[pb.StatusResponse]:
    return self._status() if timeout is None else self._status(timeout=timeout)

  def _rpc(self, host: int, method: str, request: Any, decode: Callable[[Any], Any], *,
           timeout: float | None = None, held: list | None = None, now: bool = False
           ) -> concurrent.futures.Future:
    """Sends ``request`` to ``host``'s ``method``; a Future of ``decode(response)``.

    ``held``: arrays whose arena blocks the request names, kept alive until the reply
    (the sidecar then holds them itself): a block let go of sooner could be gone.
    ``now``: the caller waits for the answer at once: off the main thread, the call is
    made on the calling thread (``_Call.run``), the Future answered when this returns.
    """
    (host,) = self._select([host])  # HostLostError / InvalidArgumentError, raised here
    call = _Call(self._connection(host), host, method, request, decode, held,
                 time.monotonic() + (self._timeout if timeout is None else timeout),
                 self._retries)
    if now:
      call.run()
    else:
      call.send()
    return call.out

  def open(self, host, directory, *, ram_steps, ram_budget, sweep, job="", holder=""):
    w = self._worker(host)  # the job holds the directory while this worker is attached
    request = ckpt_pb.CheckpointOpenRequest(
        directory=directory, ram_steps=ram_steps, sweep=sweep, job=job, holder=holder,
        worker_session=w.session if w is not None else "")
    if ram_budget is not None:
      request.ram_budget = ram_budget
    return self._rpc(host, "Open", request, lambda r: list(r.steps))

  def send(self, host, value, *, timeout=None):
    w = self._worker(host)  # a Begin's or Stage's save is in flight while it is attached
    method, request = save_wire.request_of(
        value, worker_session=w.session if w is not None else "",
        to_arena=w.ref_of if w is not None else None)
    stage = value if isinstance(value, Stage) else None
    # A Stage's blocks are kept until it answered; one that begins its step is waited for
    # at once (save() waits for its answer).
    return self._rpc(host, method, request, functools.partial(save_wire.answer_from_pb, value),
                     timeout=timeout, held=[s.data for s in stage.shards] if stage else None,
                     now=stage is not None and stage.begin is not None)

  def delete(self, host, directory, step, *, set_aside=False):
    return self._rpc(host, "Delete", ckpt_pb.CheckpointDeleteRequest(
        directory=directory, step=step, set_aside=set_aside),
        lambda r: r.set_aside_as if set_aside else None)

  def forget(self, host, directory, step):
    return self._rpc(host, "Forget", ckpt_pb.CheckpointForgetRequest(
        directory=directory, step=step), lambda r: None)

  def drop_ram_tier(self, host, directory):
    return self._rpc(host, "DropRamTier", ram_drop.request(directory, None),
                     functools.partial(ram_drop.from_pb, host))

  def replicate(self, host, final_dir, targets, *, bandwidth, timeout):
    request = ckpt_pb.CheckpointReplicateRequest(
        final_dir=final_dir, timeout_s=timeout,
        hosts=[int(t) for t in targets])
    if bandwidth is not None:
      request.bandwidth = bandwidth
    return self._rpc(host, "Replicate", request, wire.replicated_from_pb, timeout=timeout)

  def held(self, host, directory, *, timeout=None):
    return self._rpc(host, "Held", ckpt_pb.CheckpointHeldRequest(directory=directory),
                     wire.held_from_pb, timeout=timeout)

  def info(self, host, final_dir, *, taken_over=False):
    return self._rpc(host, "Info", ckpt_pb.CheckpointInfoRequest(
        final_dir=final_dir, taken_over=taken_over), wire.manifest_from_pb)

  def read(self, host, final_dir, record, *, tier, checked=True, byte_range=None,
           private=False):
    if tier not in wire.TIERS:
      raise errors.InvalidArgumentError(
          f"tier must be one of {sorted(map(str, wire.TIERS))}, got {tier!r}")
    w = self._worker(host)
    request = ckpt_pb.CheckpointReadRequest(
        final_dir=final_dir, record=wire.record_to_pb(record), tier=wire.TIERS[tier],
        worker_session=w.session if w is not None else "", unchecked=not checked)
    if byte_range is not None:  # the wire keeps its field's name, part
      request.part.offset, request.part.nbytes = byte_range
    from_arena: codec.FromArena | None = (
        functools.partial(w.view, private=private) if w is not None else None)
    return self._rpc(host, "Read", request,
                     lambda r: wire.data_from_pb(r.data, from_arena, f"shard from host {host}"))
