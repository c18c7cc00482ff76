"""The gRPC ``sidecar.v1.Checkpoint`` service: the checkpoint calls, typed, off ``Call``.

Each rpc parses its request from raw bytes (malformed bytes get INVALID_ARGUMENT),
needs a handshake session as ``Call`` does (and the token, which the server's
interceptor checks for every service), checks every field (a step >= 0, a path that
is not empty; the parts resolve each path under the checkpoint roots), calls the part
of :class:`~sidecar._src.server.checkpoint.checkpoints.Checkpoints` that does the work (its
``writer``, ``replicator``, or the checkpoints themselves for what spans them), and leaves through
``protocol.abort`` on failure, so the status codes are ``Call``'s. ``Receive`` is a
client stream: another sidecar's replica of one step, its shards' bytes raw in each message.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import logging
import math
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from sidecar._src.ckptfmt.records import Manifest
from sidecar._src.ckptfmt.save_values import Abort, AwaitCommit, Begin
from sidecar._src.core import errors
from sidecar._src.server import client_log, isolation as isolation_lib, metrics as metrics_lib
from sidecar._src.server.arenas.arena_io import ArenaIO
from sidecar._src.server.checkpoint import (
  copies,
  links as links_lib,
  ram_yield,
  restores,
  roots as roots_lib,
)
from sidecar._src.server.checkpoint.caller import LONG_S, Caller
from sidecar._src.server.checkpoint.checkpoints import Checkpoints
from sidecar._src.server.checkpoint.write import made_meanwhile, os_error_text
from sidecar._src.server.limits import CheckpointSlots, InlineBytes, Sessions, Slots
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.wire import checkpoint_wire as wire, codec, pbscan, protocol, save_wire
from sidecar._src.wire.protocol import ckpt_pb

log = logging.getLogger(__name__)
Handler = Callable[[Any, grpc.ServicerContext], Any]


def _step(step: int, name: str = "step") -> int:
  if step < 0:
    raise errors.InvalidArgumentError(f"{name} must be a non-negative int, got {step}")
  return step


def _timeout(seconds: float, context: grpc.ServicerContext, name: str = "timeout_s") -> float:
  """How long a waiting rpc may wait: ``seconds`` (0: ``LONG_S``), never past the caller's
  own deadline, so a caller that gave up does not keep its thread and slot."""
  if not math.isfinite(seconds) or seconds < 0:
    raise errors.InvalidArgumentError(
        f"{name} must be finite and >= 0 seconds (0: the longest wait), got {seconds}")
  wait = min(seconds or LONG_S, LONG_S)
  left = context.time_remaining()
  return wait if left is None else max(min(wait, left), 0.0)


# The fields of the Checkpoint service's requests that name a path: with per-client
# tokens each must lie in a directory the caller's client opened.
_PATH_FIELDS = ("directory", "tmp_dir", "final_dir")
# The rpcs that check who may act where themselves (the pool's operator may name any; the
# sidecars' agreement is the job's sidecars' own).
_OWN_CHECKS = ("DropRamTier", "Agree")
# The rpcs of the peer token's sessions (the job's sidecars), which are no tenant's.
_REPLICA_LINK_RPCS = ("Receive", "Agree")


def _session(context: grpc.ServicerContext) -> str:
  """The caller's handshake session (``_guard`` checked it is live)."""
  return str(dict(context.invocation_metadata()).get(protocol.SESSION_KEY))


# A Stage request's large inline shards, left in its bytes by ``_parse_stage``, for
# ``stage`` (on the rpc's thread, while it runs).
_STAGE_VIEWS: contextvars.ContextVar[tuple[memoryview, ...]] = contextvars.ContextVar(
    "stage_views", default=())

_PIECE = ckpt_pb.ReceiveRequest.DESCRIPTOR.fields_by_name["part"].number  # a wire name
_DATA = ckpt_pb.ReplicaPart.DESCRIPTOR.fields_by_name["data"].number


def parse_receive(raw: bytes) -> tuple[ckpt_pb.ReceiveRequest, memoryview | None]:
  """A ReceiveRequest, with its part's ``data`` as a view of ``raw`` instead of a copy.

  Protobuf would copy a part's bytes twice (parsing, then reading the field), about
  1.3 ms per 8 MiB part; the view costs nothing, and the bytes are copied once, into
  the arena. The message comes back with ``part.data`` empty. Where the scan meets
  what the sender never writes (a field twice, a group), protobuf parses it all.
  """
  try:
    parts = pbscan.length_delimited(raw, 0, len(raw), _PIECE)
    if len(parts) == 1:
      field_start, start, end = parts[0]
      datas = pbscan.length_delimited(raw, start, end, _DATA)
      if len(datas) == 1:
        data_start, value_start, value_end = datas[0]
        message = codec.parse(ckpt_pb.ReceiveRequest, raw[:field_start] + raw[end:])
        part = raw[start:data_start] + raw[value_end:end]  # the part, but its data
        message.part.CopyFrom(codec.parse(ckpt_pb.ReplicaPart, part))
        return message, memoryview(raw)[value_start:value_end]
  except (ValueError, IndexError):
    pass  # malformed: protobuf's own parse says how
  return codec.parse(ckpt_pb.ReceiveRequest, raw), None


def _steps_pb(copies: list[ram_yield.Copy]) -> list[ckpt_pb.RamTierSteps]:
  """``copies`` as one RamTierSteps per directory."""
  out: dict[str, ckpt_pb.RamTierSteps] = {}
  for c in copies:
    entry = out.setdefault(c.directory, ckpt_pb.RamTierSteps(directory=c.directory))
    entry.steps.append(c.step)
    entry.nbytes += c.nbytes
  return list(out.values())



def _threads_after_answer(handler: Callable[..., Any]) -> Callable[..., Any]:
  """A handler whose threads (a Stage's: its step's writer, its commit taken over) start
  once its call ended, answered or failed, not while it answers. The writer writes and
  checksums on idle-class threads that hold the GIL between their calls into C: on a busy
  host (the OS runs them last), the Stage that spawned them waited behind them for the
  GIL before it answered (its handler's median 2.5-2.6 ms, p90 up to 8.5, against 1.4 and
  1.8 with their start held back, at a load of 9-10 on this 2-core machine; issue 69's
  ``benchmarks/save_return``). The step is written that much later (a fraction of a ms)."""
  @functools.wraps(handler)
  def wrapper(self: CheckpointService, r: Any, context: grpc.ServicerContext) -> Any:
    with self._checkpoints.holding_spawns() as start:
      try:
        return handler(self, r, context)
      finally:
        if not context.add_callback(start):  # ended already
          start()
  return wrapper


def _documented(rpc: str, e: Exception) -> Exception:
  """One of the documented errors for what a Checkpoint rpc raised that is none (a
  request nested past the interpreter's depth, a path that is a symlink loop, a file
  system's error): no ``UNKNOWN: builtins.*`` crosses the wire for what a request or the
  disk caused. Anything else is a bug of ours, and goes as it is."""
  if isinstance(e, RecursionError):
    return errors.InvalidArgumentError(
        f"{rpc}: the request is nested too deeply to read (a JSON field or a message "
        "within messages); send a flatter one")
  if isinstance(e, OSError):
    if isinstance(e, FileExistsError):  # (the sidecars' own commit raises it typed)
      return made_meanwhile(rpc, e)
    what, where = os_error_text(e)
    if e.errno in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENOTDIR):
      return errors.PermissionDeniedError(
          f"{rpc}: the sidecar may not use a path of this checkpoint{where}: {what}; "
          "checkpoint directories and their files must be plain directories and files "
          "the sidecar's user can write")
    return errors.CheckpointWriteError(f"{rpc}: {what}{where}", errno=e.errno,
                                       path=e.filename)
  return e

class CheckpointService:
  """Handlers for ``sidecar.v1.Checkpoint``; owns no resources, only references."""

  def __init__(self, *, checkpoints: Checkpoints, arena_io: ArenaIO, sessions: Sessions,
               metrics: metrics_lib.Recorder = metrics_lib.OFF,
               slots: Slots | None = None, per_client: bool = False,
               inline: InlineBytes | None = None, tenancy: tenants_lib.Tenancy | None = None,
               isolation: isolation_lib.Isolation = isolation_lib.IN_PROCESS):
    self._checkpoints = checkpoints
    self._tenancy = tenancy  # whose each worker session is (a replica link's: its tenant's)
    # The bytes of large inline requests decoded at once: a Stage's shards, as a call's.
    self._inline = InlineBytes() if inline is None else inline
    self._per_client = per_client  # each client acts only in the directories it opened
    self._slots = CheckpointSlots() if slots is None else slots
    self._arena_io = arena_io  # views of a caller's blocks, results leased to it
    self._sessions = sessions
    self._metrics = metrics
    self._restores = restores.Restores(checkpoints, arena_io, inline=self._inline,
                                       metrics=metrics, isolation=isolation,
                                       allocating=self._allocating)

  def handler(self) -> grpc.GenericRpcHandler:
    unary: dict[str, tuple[Any, Any, Handler]] = {
        "Open": (ckpt_pb.CheckpointOpenRequest, ckpt_pb.CheckpointOpenResponse, self.open),
        "Begin": (ckpt_pb.CheckpointBeginRequest, ckpt_pb.CheckpointBeginResponse, self.begin),
        "Stage": (ckpt_pb.CheckpointStageRequest, ckpt_pb.CheckpointStageResponse, self.stage),
        "Prepared": (ckpt_pb.CheckpointPreparedRequest, ckpt_pb.CheckpointPreparedResponse,
                     self.prepared),
        "Commit": (ckpt_pb.CheckpointCommitRequest, ckpt_pb.CheckpointCommitResponse,
                   self.commit),
        "Committed": (ckpt_pb.CheckpointCommittedRequest, ckpt_pb.CheckpointCommittedResponse,
                      self.committed),
        "Abort": (ckpt_pb.CheckpointAbortRequest, ckpt_pb.CheckpointAbortResponse, self.abort),
        "Delete": (ckpt_pb.CheckpointDeleteRequest, ckpt_pb.CheckpointDeleteResponse,
                   self.delete),
        "Forget": (ckpt_pb.CheckpointForgetRequest, ckpt_pb.CheckpointForgetResponse,
                   self.forget),
        "DropRamTier": (ckpt_pb.DropRamTierRequest, ckpt_pb.DropRamTierResponse,
                        self.drop_ram_tier),
        "Replicate": (ckpt_pb.CheckpointReplicateRequest, ckpt_pb.CheckpointReplicateResponse,
                      self.replicate),
        "Held": (ckpt_pb.CheckpointHeldRequest, ckpt_pb.CheckpointHeldResponse,
                 self._restores.held),
        "Info": (ckpt_pb.CheckpointInfoRequest, ckpt_pb.CheckpointInfoResponse,
                 self._restores.info),
        "Read": (ckpt_pb.CheckpointReadRequest, restores.ReadResponse, self._restores.read),
        "Agree": (ckpt_pb.AgreeState, ckpt_pb.AgreeState, self.agree),
    }
    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            self._guard(name, request_cls, fn), request_deserializer=None,
            response_serializer=response_cls.SerializeToString)
        for name, (request_cls, response_cls, fn) in unary.items()}
    methods["Receive"] = grpc.stream_unary_rpc_method_handler(
        self._guard("Receive", None, self.receive), request_deserializer=None,
        response_serializer=ckpt_pb.ReceiveResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(protocol.CHECKPOINT_SERVICE, methods)

  def _guard(self, name: str, request_cls: Any, fn: Handler) -> Handler:
    """Parses, checks the session, runs ``fn``, records it; every failure a status."""
    label = f"sidecar.ckpt.{name.lower()}"

    def handle(raw: Any, context: grpc.ServicerContext) -> Any:
      self._metrics.call_started("checkpoint")
      t0, code = time.perf_counter(), "OK"
      try:
        session = dict(context.invocation_metadata()).get(protocol.SESSION_KEY)
        self._sessions.use(session)
        # RESOURCE_EXHAUSTED when full; then the parse. The checks of who may act where
        # and the act see one resolution of each path (a symlink swapped in between them
        # leads nowhere else).
        with (self._slots.hold(str(session)), contextlib.ExitStack() as inline,
              roots_lib.one_resolution()):
          if request_cls is ckpt_pb.CheckpointStageRequest:
            request = self._parse_stage(raw, session, context, inline)
          else:
            request = raw if request_cls is None else codec.parse(request_cls, raw)
          client = self._sessions.client(session) if self._per_client else None
          if client == "" and name not in _REPLICA_LINK_RPCS:  # the peer token's: no tenant
            raise errors.PermissionDeniedError(
                f"{name}: the peer token is the sidecars' own, for their replicas "
                "(Receive) and their agreements (Agree) only; it is no tenant and may not "
                "checkpoint: present a tenant's token")
          if client == tenants_lib.OPERATOR and name != "DropRamTier":  # no tenant either
            raise errors.PermissionDeniedError(tenants_lib.operator_denied(name))
          if client is not None and name == "Open":
            self._checkpoints.open_for(client, request.directory)  # refused if another's
          elif client is not None and request_cls is not None and name not in _OWN_CHECKS:
            for field in _PATH_FIELDS:
              if field in request_cls.DESCRIPTOR.fields_by_name and getattr(request, field):
                self._checkpoints.check_client(client, getattr(request, field), field)
          with tenants_lib.acting_as(client):  # its blocks (reads) in its tenant's arena
            return fn(request, context)
      except Exception as e:  # Every failure becomes a status; the server keeps serving.
        who = client_log.client_of(self._sessions.client(session), session, context.peer())
        if not isinstance(e, errors.SidecarError):
          client_log.DEFAULT.warning(log, who, "%s raised %s: %s", label, type(e).__name__,
                                     protocol.for_log(e))
          e = _documented(name, e)
        else:
          client_log.DEFAULT.info(log, who, "%s: %s: %s", label, type(e).__name__,
                                  protocol.for_log(e))
        code = protocol.status_code(e).name
        protocol.abort(context, e)
      finally:
        self._metrics.call_done("checkpoint", label, code, time.perf_counter() - t0)
    return handle

  def _parse_stage(self, raw: bytes, session: object, context: grpc.ServicerContext,
                   inline: contextlib.ExitStack) -> ckpt_pb.CheckpointStageRequest:
    """A Stage request, its large inline shards left in ``raw`` (``stage`` views them
    there: ``_STAGE_VIEWS``) and counted as inline bytes, as a call's arrays are: within
    its tenant's ``inline_bytes`` and the sidecar's budget of them, held in ``inline``.
    """
    codec.check_message_count(raw, ckpt_pb.CheckpointStageRequest.DESCRIPTOR,
                              what=f"a CheckpointStageRequest of {len(raw)} bytes")
    stripped, views = pbscan.strip_arrays(raw, ckpt_pb.CheckpointStageRequest.DESCRIPTOR)
    if views:
      tenant = self._sessions.client(session)
      self._metrics.tenant_requested(tenant, "inline", len(raw))
      with tenants_lib.acting_as(tenant), self._metrics.waiting(tenant, "inline"):
        inline.enter_context(self._inline.hold(len(raw), context.time_remaining()))
      if not context.is_active():
        raise errors.DeadlineExceededError(
            "a Stage whose caller left while it waited for room to decode it: not staged")
    inline.callback(_STAGE_VIEWS.reset, _STAGE_VIEWS.set(tuple(views)))
    return codec.parse(ckpt_pb.CheckpointStageRequest, stripped, counted=True)

  def _allocating(self, context: grpc.ServicerContext, wait_s: float | None = None
                  ) -> contextlib.AbstractContextManager:
    """``sidecar.empty`` in the arena for this request (reads from storage, replica parts),
    each waiting for room at most ``wait_s`` (None: the caller's deadline)."""
    if wait_s is None:
      return self._arena_io.allocating(context.is_active, context.time_remaining)

    def left() -> float:
      remaining = context.time_remaining()
      return wait_s if remaining is None else min(remaining, wait_s)
    return self._arena_io.allocating(context.is_active, left)

  # ---- save --------------------------------------------------------------

  def open(self, r: ckpt_pb.CheckpointOpenRequest, context: grpc.ServicerContext
           ) -> ckpt_pb.CheckpointOpenResponse:
    # Held for the job first (refused if another live job holds it): its sweep below must
    # never remove another job's uncommitted steps.
    session, worker = _session(context), r.worker_session
    self._checkpoints.jobs.open(
        self._checkpoints.resolve(r.directory, "directory"), r.job, holder=r.holder,
        alive=(lambda: self._arena_io.is_attached(worker)) if worker
        else (lambda: self._sessions.live(session)))
    steps = self._checkpoints.writer.open(
        r.directory, r.ram_steps, r.ram_budget if r.HasField("ram_budget") else None, r.sweep,
        wait_s=context.time_remaining())
    self._checkpoints.reopened(r.directory)  # fewer ram_steps than before: the others go now
    return ckpt_pb.CheckpointOpenResponse(steps=steps)

  def _client(self, context: grpc.ServicerContext) -> str | None:
    """The caller's client (a pool's tenant), where each has its own checkpoints."""
    return self._sessions.client(_session(context)) if self._per_client else None

  def _caller(self, context: grpc.ServicerContext, worker: str = "", asked: float = 0.0
              ) -> Caller:
    """What this sidecar knows of who sent a request (``caller.Caller``): its session,
    the worker it names (the trainer is there while that is attached: its connection
    closes as its process dies), its tenant, and how long it waits (``asked`` seconds,
    as :func:`_timeout` bounds them)."""
    alive = (lambda: self._arena_io.is_attached(worker)) if worker else None
    return Caller(owner=_session(context), worker=worker, alive=alive,
                  tenant=self._client(context), wait_s=_timeout(asked, context))

  def begin(self, r: ckpt_pb.CheckpointBeginRequest, context: grpc.ServicerContext
            ) -> ckpt_pb.CheckpointBeginResponse:
    _step(r.step)
    begin, caller = save_wire.begin_from_pb(r), self._caller(context, r.worker_session)
    self._check_begin(begin, caller)
    return ckpt_pb.CheckpointBeginResponse(
        tmp_directory=self._checkpoints.writer.begin(begin, caller))

  def _check_begin(self, begin: Begin, caller: Caller) -> None:
    """What the policy says of ``begin`` (a Begin's, or a Stage's that begins its step):
    room at the storage, and, per client, the step's directory its own (DCP's lies beside
    ``begin.directory``)."""
    self._checkpoints.check_storage(caller.tenant, begin.directory, 0)
    if caller.tenant is not None:
      tmp = self._checkpoints.writer.tmp_of(begin.directory, begin.step, begin.format)
      self._checkpoints.check_client(caller.tenant, tmp, "the step's uncommitted directory")

  @_threads_after_answer
  def stage(self, r: ckpt_pb.CheckpointStageRequest, context: grpc.ServicerContext
            ) -> ckpt_pb.CheckpointStageResponse:
    """A part of a step, staged; its first part on the host that begins the step begins
    it first (``StepWriter.begin_staged``), whose writer thread then finishes the step's
    uncommitted directory (``finish_tmp``), off the trainer's wait."""
    _step(r.step)
    stage = save_wire.stage_from_pb(
        r, lambda ref: self._arena_io.view(ref, r.worker_session), _STAGE_VIEWS.get())
    caller = self._caller(context, r.worker_session)
    begun, finish_tmp = "", None
    if stage.begin is not None:
      self._check_begin(stage.begin, caller)
      begun, finish_tmp = self._checkpoints.writer.begin_staged(stage, caller)
    try:  # checked and reserved under one lock (a quota that racing parts cannot pass)
      with self._checkpoints.storage_reserved(caller.tenant, stage.directory,
                                              sum(s.data.nbytes for s in stage.shards)):
        staged = self._checkpoints.writer.stage(stage, caller, finish_tmp=finish_tmp)
    except BaseException as e:
      if begun:  # as if never begun: the trainer's abort of a failed begin removes nothing
        self._checkpoints.agreements.abort(stage.final_dir)
        self._checkpoints.writer.abort(Abort(begun, stage.final_dir), caller)
      # A refused part lets its blocks go at once: no frame the error passed through keeps
      # its (immutable) shards.
      traceback.clear_frames(e.__traceback__)
      del stage
      raise
    return ckpt_pb.CheckpointStageResponse(staged_bytes=staged)

  def prepared(self, r: ckpt_pb.CheckpointPreparedRequest, context: grpc.ServicerContext
               ) -> ckpt_pb.CheckpointPreparedResponse:
    prepared = save_wire.prepared_from_pb(r)
    written = self._checkpoints.writer.prepared(
        prepared, self._caller(context, asked=prepared.timeout_s))
    return ckpt_pb.CheckpointPreparedResponse(records=[wire.record_to_pb(c) for c in written])

  def commit(self, r: ckpt_pb.CheckpointCommitRequest, context: grpc.ServicerContext
             ) -> ckpt_pb.CheckpointCommitResponse:
    step = _step(r.step)
    commit, caller = save_wire.commit_from_pb(r), self._caller(context)
    if isinstance(commit, AwaitCommit):  # the sidecars commit it: wait for their decision
      return ckpt_pb.CheckpointCommitResponse(
          committed=self._checkpoints.agreements.await_commit(
              self._checkpoints.resolve(commit.tmp_dir, "tmp_dir"), step, caller.owner,
              caller.wait_s))
    if r.num_hosts < 1:
      raise errors.InvalidArgumentError(f"num_hosts must be >= 1, got {r.num_hosts}")
    return ckpt_pb.CheckpointCommitResponse(
        committed=self._checkpoints.writer.commit(commit, caller))

  def committed(self, r: ckpt_pb.CheckpointCommittedRequest, _: grpc.ServicerContext
                ) -> ckpt_pb.CheckpointCommittedResponse:
    told = save_wire.committed_from_pb(r)
    manifest = (Manifest.from_json(told.manifest_json, "manifest_json") if told.manifest_json
                else None)
    return ckpt_pb.CheckpointCommittedResponse(
        kept_steps=self._checkpoints.committed(told.final_dir, manifest))

  def abort(self, r: ckpt_pb.CheckpointAbortRequest, context: grpc.ServicerContext
            ) -> ckpt_pb.CheckpointAbortResponse:
    """Drops a failed save; a step whose commit began here is aborted once that commit
    ended, and only if it did not commit it (``committed`` then says where it did)."""
    abort = save_wire.abort_from_pb(r)
    self._checkpoints.resolve(abort.final_dir, "final_dir")
    self._checkpoints.agreements.abort(abort.final_dir)  # the RAM tier's key, as staged
    return ckpt_pb.CheckpointAbortResponse(
        committed=self._checkpoints.writer.abort(abort, self._caller(context)))

  def delete(self, r: ckpt_pb.CheckpointDeleteRequest, _: grpc.ServicerContext
             ) -> ckpt_pb.CheckpointDeleteResponse:
    moved = self._checkpoints.writer.delete(r.directory, _step(r.step), set_aside=r.set_aside)
    return ckpt_pb.CheckpointDeleteResponse(set_aside_as=moved)

  def forget(self, r: ckpt_pb.CheckpointForgetRequest, _: grpc.ServicerContext
             ) -> ckpt_pb.CheckpointForgetResponse:
    self._checkpoints.forget(r.directory, _step(r.step))
    return ckpt_pb.CheckpointForgetResponse()

  def drop_ram_tier(self, r: ckpt_pb.DropRamTierRequest, context: grpc.ServicerContext
                    ) -> ckpt_pb.DropRamTierResponse:
    """Drops a directory's or a tenant's durable RAM-tier copies: a tenant its own, the
    pool's operator (its operator token, client ``OPERATOR``; any caller where there are
    no tenants) anyone's."""
    if bool(r.directory) == bool(r.tenant):
      raise errors.InvalidArgumentError(
          "DropRamTier: name a directory or a tenant (one of them), got directory="
          f"{r.directory!r:.200} tenant={r.tenant!r:.100}")
    client = self._client(context)
    if client == tenants_lib.OPERATOR:
      client = None  # anyone's
    if r.tenant and not self._per_client:
      raise errors.InvalidArgumentError(
          f"tenant {r.tenant!r:.100}: this sidecar has no tenants (no pool file or "
          "--client-tokens); drop a directory's RAM-tier copies instead")
    if r.tenant and client and r.tenant != client:
      raise errors.PermissionDeniedError(
          f"tenant {client!r} may drop only its own RAM-tier copies, not tenant "
          f"{r.tenant!r:.100}'s; the pool's operator (its operator token) may drop any")
    if r.tenant:
      dropped, kept = self._checkpoints.drop_tenant_ram(r.tenant)
    else:
      if client:
        self._checkpoints.check_client(client, r.directory, "directory")
      dropped, kept = self._checkpoints.drop_ram(r.directory)
    return ckpt_pb.DropRamTierResponse(dropped=_steps_pb(dropped), kept=_steps_pb(kept))

  # ---- replicas -----------------------------------------------------------

  def replicate(self, r: ckpt_pb.CheckpointReplicateRequest, context: grpc.ServicerContext
                ) -> ckpt_pb.CheckpointReplicateResponse:
    if r.HasField("bandwidth") and r.bandwidth < 1:
      raise errors.InvalidArgumentError(
          f"bandwidth must be absent or bytes per second >= 1, got {r.bandwidth}")
    # Host ids only: their addresses come from this sidecar's --replica-hosts.
    return wire.replicated_to_pb(self._checkpoints.replicator.replicate(
        r.final_dir, list(r.hosts), _timeout(r.timeout_s, context),
        r.bandwidth if r.HasField("bandwidth") else None, tenant=self._client(context)))

  def receive(self, requests: Iterator[bytes], context: grpc.ServicerContext
              ) -> ckpt_pb.ReceiveResponse:
    """Another sidecar's replica of one step: the header, then blocks or pieces, then
    ``done``.

    Only a replica link's session sends one (its handshake carried the peer token): a
    controller's, whatever token it holds, could plant shards a restore would take.
    """
    if not self._sessions.is_replica_link(_session(context)):
      raise errors.PermissionDeniedError(
          "Receive: replicas are accepted only from this job's other sidecars, whose handshake "
          f"carries the peer token ('{protocol.REPLICA_KEY}' metadata); this session's did not. "
          "Give every sidecar the same --peer-token-file (or SIDECAR_PEER_TOKEN)")
    first, data = parse_receive(next(requests, b""))
    if not first.HasField("header"):
      raise errors.InvalidArgumentError("the first ReceiveRequest must carry the header")
    header = wire.replica_header_from_pb(first.header, "header")
    # Whose replica: the sending sidecar authenticated its caller (we trust the sender by
    # its peer token); its blocks count against that tenant here.
    tenant = first.header.tenant or None
    session = first.worker_session
    links_lib.check_sender(self._tenancy, session, tenant)  # blocks and header: one tenant's
    view = lambda ref: self._arena_io.view(ref, session)
    # a resent replica starts afresh
    replica = self._checkpoints.replicator.open_replica(header, tenant)
    try:
      with tenants_lib.acting_as(tenant):
        return self._receive_all(replica, first, data, requests, view, context)
    except BaseException:
      self._checkpoints.replicator.drop_partial(replica)  # a stream cut short leaves none
      raise

  def _receive_all(self, replica: copies.Replica, message: ckpt_pb.ReceiveRequest,
                   data: memoryview | None, requests: Iterator[bytes], view: codec.FromArena,
                   context: grpc.ServicerContext) -> ckpt_pb.ReceiveResponse:
    held, n = 0, 0
    # A replica that does not fit (its tenant's ceiling here) fails soon, as one sent
    # into a full arena over shared memory does, not after the stream's hour.
    with self._allocating(context, links_lib.ARENA_WAIT_S):
      while True:
        if message.HasField("header") and n:
          raise errors.InvalidArgumentError(f"ReceiveRequest {n}: only the first has a header")
        held = self._receive_one(replica, message, view, n, data)
        if message.done:
          return ckpt_pb.ReceiveResponse(nbytes=held)
        raw = next(requests, None)
        if raw is None:
          raise errors.InvalidArgumentError(
              f"the replica of step {replica.step} from host {replica.source} ended "
              "without `done`: it is not whole")
        (message, data), n = parse_receive(raw), n + 1

  def _receive_one(self, replica: copies.Replica, m: ckpt_pb.ReceiveRequest,
                   view: codec.FromArena, n: int,
                   data: memoryview | None) -> int:
    where = f"ReceiveRequest {n}"
    if m.blocks and m.HasField("part"):
      raise errors.InvalidArgumentError(f"{where}: blocks or a part, not both")
    blocks = wire.replica_blocks_from_pb(m.blocks, view, f"{where}.blocks")
    piece, payload = None, None
    if m.HasField("part"):
      piece = wire.replica_piece_from_pb(m.part, f"{where}.part")
      payload = np.frombuffer(m.part.data if data is None else data, np.uint8)
    try:
      return self._checkpoints.replicator.receive(replica, blocks, piece, payload, done=m.done)
    finally:
      blocks.clear()

  def agree(self, r: ckpt_pb.AgreeState, context: grpc.ServicerContext) -> ckpt_pb.AgreeState:
    """Another sidecar's state in the sidecars' agreement on a step (``agreement.py``):
    from the peer token's sessions only, where the sidecars have one (and always with
    tenants: a tenant's trainer could otherwise vouch for another's step)."""
    if ((self._checkpoints.needs_replica_token or self._per_client)
        and not self._sessions.is_replica_link(_session(context))):
      raise errors.PermissionDeniedError(
          "Agree: the sidecars' agreement on a step is accepted only from this job's other "
          f"sidecars, whose handshake carries the peer token ('{protocol.REPLICA_KEY}' "
          "metadata); this session's did not")
    state = wire.agree_from_pb(r, "AgreeState", sender=f"host {r.host}'s sidecar")
    self._checkpoints.resolve(state.final_dir, "final_dir")
    return wire.agree_to_pb(self._checkpoints.agreements.agree(state))
