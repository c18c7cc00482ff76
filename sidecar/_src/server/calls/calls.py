"""Running registered code for a caller: arguments decoded and checked, results encoded.

Shared by the two ways in: the gRPC service (controllers anywhere) and the
worker socket (the device-owning process on this host, the fast path). A unary
call runs here; streams and feeds (``streams``) take their entry and arguments
from :meth:`Runner.prepare` too. What touches the arena is ``arena_io``'s.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from sidecar._src.core import errors
from sidecar._src.server import isolation as isolation_lib, limits, metrics as metrics_lib, policies
from sidecar._src.server.arenas.arena_io import Alive, ArenaIO, TimeLeft
from sidecar._src.server.calls import argument_types
from sidecar._src.server.limits import InlineBytes, Slots
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import codec, parts as parts_lib, pbscan, protocol
from sidecar._src.wire.protocol import pb


class Runner:
  """Decodes calls, runs registered functions, encodes their results.

  Args:
    registry: the user's registered functions and pipelines.
    arena_io: where arguments' views and results' blocks come from.
    metrics: what calls are reported to.
    policy: what the client may run (a pool tenant's allowlists: ``pool/tenant_checks``);
      by default, everything registered.
    isolation: where a tenant's calls, streams and feeds run: in its own processes with a
      pool file (``tenant_procs/``); by default here.
  """

  def __init__(self, *, registry: registry_lib.Registry, arena_io: ArenaIO,
               metrics: metrics_lib.Recorder = metrics_lib.OFF,
               policy: policies.CallPolicy = policies.OPEN_CALLS,
               isolation: isolation_lib.Isolation = isolation_lib.IN_PROCESS):
    self.registry = registry
    self.policy = policy
    self.isolation = isolation
    self.metrics = metrics
    self.arena_io = arena_io
    self._lock = threading.Lock()
    self.calls = 0  # calls, streams and feeds whose arguments were accepted

  def prepare(self, request: pb.CallRequest, kind: str = registry_lib.FUNCTION, *,
              views: list[memoryview] | None = None) -> tuple[registry_lib.Entry, tuple, dict]:
    """The registered entry and decoded, signature-checked arguments of a call.

    ``views``: the large inline arrays' bytes, where ``pbscan.strip_arrays`` left them.
    """
    self.policy.check(kind, request.name, request.worker_session)
    entry = self.registry.get(kind, request.name)
    view = lambda ref: self.arena_io.view(ref, request.worker_session)
    args, kwargs = decode_arguments(entry, request, from_arena=view, views=views)
    with self._lock:
      self.calls += 1
    return entry, args, kwargs

  def admit(self, request: pb.CallRequest, kind: str = registry_lib.FUNCTION
            ) -> registry_lib.Entry:
    """The registered entry of a call that runs elsewhere (its tenant's process, where its
    arguments are decoded: ``decode_arguments``), once its client may run it.

    Raises:
      PermissionDeniedError: the policy refuses it. NotRegisteredError: no such name.
    """
    self.policy.check(kind, request.name, request.worker_session)
    entry = self.registry.get(kind, request.name)
    with self._lock:
      self.calls += 1
    return entry

  def label(self, kind: str, name: str) -> str:
    """``name`` if it is registered (the metrics' label), else ``<unregistered>``."""
    return name if self.registry.has(kind, name) else metrics_lib.UNREGISTERED

  def call(self, request: pb.CallRequest, *, alive: Alive, time_left: TimeLeft,
           views: list[memoryview] | None = None,
           inline: list[np.ndarray] | None = None) -> pb.Value:
    """Runs a unary call; its result, encoded (large arrays leased to its worker).

    ``inline``: for a caller without a worker session, where the result's arrays of
    ``pbscan.BIG_ARRAY`` bytes or more go: the value refers to each by an ``ArenaRef``
    whose offset is its index there, for ``pbscan.splice_arrays`` to write inline.
    """
    if not self.metrics.enabled:
      return self._call(request, alive=alive, time_left=time_left, views=views, inline=inline)
    with measured(self.metrics, "call", self.label(registry_lib.FUNCTION, request.name)):
      return self._call(request, alive=alive, time_left=time_left, views=views, inline=inline)

  def _call(self, request: pb.CallRequest, *, alive: Alive, time_left: TimeLeft,
            views: list[memoryview] | None, inline: list[np.ndarray] | None) -> pb.Value:
    entry, args, kwargs = self.prepare(request, views=views)
    with self.arena_io.allocating(alive, time_left):
      result = entry.fn(*args, **kwargs)
    del args, kwargs  # a result that is no argument: their memory back before encoding
    where = f"result of {request.name!r}"
    if inline is not None and not request.worker_session:
      return codec.encode(result, to_arena=functools.partial(_set_aside, inline),
                          inline_limit=pbscan.BIG_ARRAY, where=where)
    value = self.arena_io.encode(result, request.worker_session, alive=alive,
                                 time_left=time_left, where=where)
    if (blocks := codec.arena_blocks(value)) and not alive():
      # Its caller left (its deadline passed, it cancelled): nobody will read the answer,
      # and its blocks would stay leased to the worker session until that ended.
      self.arena_io.release(blocks, request.worker_session)
      raise errors.DeadlineExceededError(
          f"the caller of {request.name!r} left before its result was sent; the result's "
          "arena blocks went back")
    return value


def decode_arguments(entry: registry_lib.Entry, request: pb.CallRequest, *,
                     from_arena: Callable[[codec.ArenaRef], np.ndarray],
                     views: list[memoryview] | None = None) -> tuple[tuple, dict]:
  """A request's arguments for ``entry``, decoded (arena references through
  ``from_arena``; ``views``: the large inline arrays' bytes, where ``pbscan.strip_arrays``
  left them) and checked against its signature and annotations.

  Raises:
    InvalidArgumentError: naming the argument and what was wrong.
  """
  # One budget for the request: what it costs to decode is what it sent.
  budget = codec.Budget(views=views or [])
  args = codec.decode(request.args, from_arena=from_arena, where="args", budget=budget)
  kwargs = codec.decode(request.kwargs, from_arena=from_arena, where="kwargs", budget=budget)
  if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(
      isinstance(k, str) for k in kwargs):
    raise errors.InvalidArgumentError(
        f"args must be a tuple and kwargs a dict with str keys, got {type(args).__name__} "
        f"and {type(kwargs).__name__}")
  pipeline = entry.kind == registry_lib.PIPELINE
  if entry.signature is not None:
    try:
      entry.signature.bind(*((None,) if pipeline else ()), *args, **kwargs)
    except TypeError as e:
      raise errors.InvalidArgumentError(
          f"bad arguments for {entry.kind} {entry.name!r}{entry.signature}: {e}") from None
  if pipeline:
    argument_types.check(entry.fn, kwargs, what=f"pipeline {entry.name!r}")
  elif entry.signature is not None:
    argument_types.check_call(entry.fn, entry.signature, args, kwargs,
                              what=f"{entry.kind} {entry.name!r}")
  return args, kwargs


class UnaryCalls:
  """A unary call's way in, whichever transport brought it (gRPC's Call, or a worker's
  ``calls`` connection on the Unix socket): a slot of its caller's, its values counted
  before it is parsed, large inline arrays left in its bytes, then the Runner.

  Args:
    runner: runs the call.
    slots: the calls one caller (a gRPC or worker session) and all may run at once.
    inline: the bytes of large inline requests decoded at once.
  """

  def __init__(self, runner: Runner, slots: Slots, inline: InlineBytes):
    self.runner, self.slots, self._inline = runner, slots, inline

  def run(self, raw: bytes, caller: str, *, alive: Alive, time_left: TimeLeft | None = None,
          worker: str | None = None) -> pb.CallResponse:
    """The response to a serialized CallRequest of session ``caller``.

    ``time_left``: the seconds the caller still waits (gRPC's deadline); None: from the
    request's ``timeout_s`` (the worker socket's). ``worker``: the worker session whose
    connection brought the request, which it must name as its ``worker_session``.

    Raises:
      BusyError: ``caller`` or the sidecar runs as many calls as it may.
      InvalidArgumentError: ``raw`` is malformed. Whatever the call raises.
    """
    response = self._run(raw, caller, alive=alive, time_left=time_left, worker=worker)
    if isinstance(response, pb.CallResponse):
      return response
    return codec.parse(pb.CallResponse, response)  # its tenant process's, checked there

  def run_serialized(self, raw: bytes, caller: str, *, alive: Alive,
                     time_left: TimeLeft | None = None) -> bytes:
    """:meth:`run`'s response, serialized, for gRPC's Call (``serialize``): a result's
    large inline arrays are copied once, into these bytes, rather than four times."""
    inline: list[np.ndarray] = []
    response = self._run(raw, caller, alive=alive, time_left=time_left, inline=inline)
    if not isinstance(response, pb.CallResponse):
      return bytes(response)  # its tenant process spliced its arrays in
    return pbscan.splice_arrays(response.SerializeToString(), pb.CallResponse.DESCRIPTOR,
                                inline)

  def run_in_pieces(self, total: int, pieces: Iterable[bytes], caller: str, *, alive: Alive,
                time_left: TimeLeft, limit: int) -> Iterator[bytes]:
    """The response to a CallRequest of ``total`` bytes that arrives in pieces (gRPC's
    CallParts: ``pieces``, serialized ``CallPart``s, the first included), in pieces too:
    serialized ``CallPart``s of the serialized CallResponse.

    The request's pieces are copied into one buffer as they come, within the budget of
    inline bytes (held for ``total`` first), and its large arrays are views of it: the
    request costs its size once, where one message of it cost three times its size in
    gRPC's receipt alone. The response's pieces are cut from the result's arrays as gRPC
    asks for them (``parts.cut``): it costs the result and the pieces in flight, where one
    message of it cost twice its size (its bytes, then gRPC's copy as it sent them).

    The call's slot and its inline bytes stay held until its last piece is sent: a caller
    that stops reading (gRPC's flow control then stops the sending) holds the result
    until its deadline or its cancellation, and its slot and bytes count against it and
    the sidecar's limits meanwhile.

    Raises:
      ResourceExhaustedError: ``total`` is past ``limit`` (the largest message the
        sidecar takes) or its tenant's ``inline_bytes``; BusyError: no room within the
        deadline. InvalidArgumentError: the pieces do not add up to ``total``.
    """
    if total > limit:
      raise errors.ResourceExhaustedError(
          f"a call of {total} bytes in parts is larger than this sidecar takes "
          f"(max_message_size={limit}); pass large arrays through a Worker's arena")
    metrics, tenant = self.runner.metrics, tenants_lib.CURRENT.get()
    metrics.tenant_requested(tenant, "inline", total)
    with contextlib.ExitStack() as admitted:
      with metrics.waiting(tenant, "inline"):
        admitted.enter_context(self._inline.hold(total, time_left()))
      buffer = parts_lib.assemble(total, pieces)
      with self.slots.hold(caller):
        inline: list[np.ndarray] = []
        response = self._answer(buffer, time.monotonic(), alive=alive, time_left=time_left,
                                inline=inline, held=True)
        del buffer  # its arrays' views keep what the result still needs
        if isinstance(response, pb.CallResponse):
          buffers, size = pbscan.splice_pieces(response.SerializeToString(),
                                               pb.CallResponse.DESCRIPTOR, inline)
        else:  # its tenant process's bytes, its arrays spliced in there
          buffers, size = [memoryview(response)], len(response)
        del response, inline  # the buffers view the result's arrays: nothing else holds them
        yield from parts_lib.cut(buffers, size)

  def _run(self, raw: bytes | bytearray, caller: str, *, alive: Alive,
           time_left: TimeLeft | None, worker: str | None = None,
           inline: list[np.ndarray] | None = None) -> pb.CallResponse | bytearray:
    start = time.monotonic()
    # The slot first, as for streams: parsing a big request takes a while, on its thread.
    with self.slots.hold(caller):
      return self._answer(raw, start, alive=alive, time_left=time_left, worker=worker,
                          inline=inline)

  def _answer(self, raw: bytes | bytearray, start: float, *, alive: Alive,
              time_left: TimeLeft | None, worker: str | None = None,
              inline: list[np.ndarray] | None = None, held: bool = False
              ) -> pb.CallResponse | bytearray:
    """The response to serialized CallRequest ``raw``, made in its caller's slot; a
    ``timeout_s`` in it counts from ``start``. ``held``: its bytes are held in the inline
    budget already (CallParts). A pool tenant's call runs in its process, whose answer is
    the response serialized (its large arrays spliced in where ``inline`` asks it)."""
    codec.check_message_count(raw, pb.CallRequest.DESCRIPTOR,
                              what=f"a CallRequest of {len(raw)} bytes")
    # Large inline arrays stay in ``raw``: protobuf would copy them twice more.
    stripped, views = pbscan.strip_arrays(raw, pb.CallRequest.DESCRIPTOR)
    request = codec.parse(pb.CallRequest, stripped, counted=True)
    if worker is not None and request.worker_session != worker:
      raise errors.InvalidArgumentError(
          f"a call on worker session {worker}'s connection names worker_session "
          f"{request.worker_session!r}; a connection's calls are its session's")
    if time_left is None:
      time_left = _time_left(start, request.timeout_s)
    work = self.runner.isolation.work_of(tenants_lib.CURRENT.get())
    if not views or held:
      if work is not None:
        return self._elsewhere(work, raw, request, alive=alive, time_left=time_left,
                               splice=inline is not None)
      return pb.CallResponse(result=self.runner.call(
          request, alive=alive, time_left=time_left, views=views, inline=inline))
    metrics, tenant = self.runner.metrics, tenants_lib.CURRENT.get()
    metrics.tenant_requested(tenant, "inline", len(raw))
    with contextlib.ExitStack() as admitted:
      with metrics.waiting(tenant, "inline"):  # decoding it costs its size again
        admitted.enter_context(self._inline.hold(len(raw), time_left()))
      if work is not None:
        del views  # its tenant process decodes it, into its own memory
        return self._elsewhere(work, raw, request, alive=alive, time_left=time_left,
                               splice=inline is not None)
      limits.trim_heap()
      return pb.CallResponse(result=self.runner.call(
          request, alive=alive, time_left=time_left, views=views, inline=inline))

  def _elsewhere(self, work: isolation_lib.TenantWork, raw: bytes | bytearray,
                 request: pb.CallRequest, *, alive: Alive, time_left: TimeLeft,
                 splice: bool) -> bytearray:
    """The serialized response of a call its tenant's process runs (``work``), once the
    policy and the registry here let it run."""
    runner = self.runner
    with (measured(runner.metrics, "call", runner.label(registry_lib.FUNCTION, request.name))
          if runner.metrics.enabled else contextlib.nullcontext()):
      return work.call(runner.admit(request), raw, session=request.worker_session,
                       alive=alive, time_left=time_left, splice=splice)


def serialize(response: pb.CallResponse | bytes) -> bytes:
  """gRPC's response serializer for Call: ``run_serialized``'s bytes as they are."""
  return response if isinstance(response, bytes) else response.SerializeToString()


def _set_aside(arrays: list[np.ndarray], a: np.ndarray) -> codec.ArenaRef:
  """``a`` put in ``arrays``; the placeholder ``pbscan.splice_arrays`` replaces by it."""
  arrays.append(a)
  return codec.ArenaRef(len(arrays) - 1, a.nbytes, 0, a.dtype.name, a.shape)


def _time_left(start: float, timeout_s: float) -> TimeLeft:
  """The seconds left of ``timeout_s`` from ``start`` (None: no limit, for 0)."""
  if not 0 < timeout_s < math.inf:
    if timeout_s == 0:
      return lambda: None
    raise errors.InvalidArgumentError(
        f"timeout_s must be finite seconds >= 0, got {timeout_s!r}")
  deadline = start + timeout_s
  return lambda: max(deadline - time.monotonic(), 0.0)


@contextlib.contextmanager
def measured(metrics: metrics_lib.Recorder, kind: str, label: str) -> Iterator[None]:
  """Reports a call, stream or feed (``label``: its name, see ``Runner.label``) to
  ``metrics``: in flight, then its code and time.

  A stream whose consumer went away mid-stream (its generator closed) counts as
  CANCELLED; a feed's consumer closing it is how a feed ends (its controller's or worker's
  ``close()``, the end of a ``with``): OK.
  """
  metrics.call_started(kind)
  tenant = tenants_lib.CURRENT.get()  # who it runs for (the way in set it), None: no pool
  t0, code = time.perf_counter(), "OK"
  try:
    yield
  except GeneratorExit:
    code = "OK" if kind == "feed" else "CANCELLED"
    raise
  except BaseException as e:
    code = protocol.status_code(e).name
    raise
  finally:
    metrics.call_done(kind, label, code, time.perf_counter() - t0)
    metrics.tenant_request(tenant, kind, code)
