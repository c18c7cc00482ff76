"""The wire: generated code, versions, and exceptions <-> gRPC status codes.

This is the only module that imports the code generated from
``protos/sidecar/v1/*.proto``; everything else reaches it as ``protocol.pb`` (the
``Sidecar`` service) and ``protocol.ckpt_pb`` (the ``Checkpoint`` service).

An error crosses a process boundary in one encoding, ``pb.Error`` (``error_info``),
whatever carries it: a failed RPC's trailing metadata (``abort``, read back by
``error_from_rpc``), the end item of a stream (``StreamItem.error``), or the JSON
messages of the worker socket and feed workers (``error_dict``: pb.Error's JSON
mapping). ``error_from_info`` turns it back into the matching SidecarError.
"""

from __future__ import annotations

import errno
import importlib.metadata
import platform
import traceback
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from sidecar._src.core import env as env_lib, errors
from sidecar.v1 import (
    checkpoint_pb2 as ckpt_pb,
    checkpoint_pb2_grpc as ckpt_pb_grpc,
    sidecar_pb2 as pb,
)

__all__ = ["ckpt_pb", "ckpt_pb_grpc", "pb"]

PROTOCOL_VERSION = 17  # 2: the Checkpoint service; 3: an error is one pb.Error trailer;
# 4: replicas carry their sender's crc32c and need a peer session; 5: a feed batch is a
# FeedBatch (its structure apart from its arrays), namedtuples travel; 6: a feed's length
# (FeedSpec.length_only), no Ram rpc; 7: a worker's alloc asks for sizes (one block, or a
# save's in one request); 8: calls over the worker socket (a ``calls`` connection,
# CallRequest.timeout_s, CallResponse.error); 9: CallParts, a large call in parts; Replicate
# names its targets by host id (their addresses are the sidecars' own --replica-hosts), a
# replica header its tenant; 10: a handshake over a unix: socket may ask for a ticket
# (HandshakeRequest.ticket, presented as TICKET_KEY)
# 11: CallParts answers in parts (a stream of CallPart)
# 12: a shard is one ShardRecord from Stage to the manifest (StagedShard, ShardChecksum gone;
# a Stage's records with their data beside them, replicas carry records)
# 13: a Commit "when_written": a host that alone holds a step commits it once written, its
# trainer there or not
# 14: the sidecars commit a step they took over among themselves: a trainer's last Stage
# carries the CommitPlan, the hosts agree with its committer (Agree), a Commit taken_over
# waits for that commit (when_written gone); Status lists the steps committing
# 15: the shard record both ways: a Read names the ShardRecord the manifest lists (its shard
# and crc32c fields gone), a DCP Stage's part says its rank's item count (DcpItem gone: each
# item is its shard's record)
# 16: Info taken_over (a step the sidecars took over, from a RAM tier, durable or not) and
# a RAM-tier Read of it: an in-process rollback does not wait for the disk; a Stage may
# begin its step (begin_format): a save's first part, one round trip less
# 17: a Delete may set a committed step aside (CheckpointDeleteRequest.set_aside: an older
# sidecar would delete it); a feed's credit says where its trainer saved
# (StreamRequest.saved_state_json) and FeedSpec.replay how many batches to keep for re-done
# steps (StatusResponse.arena_kept); Status's trainers carry their phase, its length, their
# last step's time and their process's CPU time (the watchdog tells busy from hung by it)
SERVICE = "sidecar.v1.Sidecar"
CHECKPOINT_SERVICE = "sidecar.v1.Checkpoint"  # internal: the checkpoint rpcs, no user calls
SESSION_KEY = "sidecar-session"
MAX_PREFETCH = 1024  # items a stream may run ahead; more would only fill the arena
AUTH_KEY = "authorization"
# Another sidecar's handshake carries ``Bearer <peer token>`` here: its session may send
# replicas (Checkpoint.Receive), which no controller's may.
REPLICA_KEY = "sidecar-peer"
# A handshake over a ``unix:`` socket carries its process's ticket here (server/client_ids):
# its sessions count against that process, as a TCP connection's against the connection.
PID_TICKET_KEY = "sidecar-pid-ticket"
# Or the ticket a handshake's answer told it (HandshakeResponse.ticket), for a client the
# abstract socket cannot tell one (server/client_ids.Fetched): held the same way, within
# the tenant whose token comes with it.
TICKET_KEY = "sidecar-ticket"
_ERROR_KEY = "sidecar-error-bin"  # a failed RPC's trailer: its pb.Error, serialized
# An error's message and traceback, in UTF-8 bytes; longer ones are cut, with a note.
MAX_ERROR_MESSAGE = 8 << 10
MAX_ERROR_TRACEBACK = 16 << 10
# Over gRPC they travel in trailing metadata (base64, 4/3 the bytes), which clients
# refuse past 8 KiB in all (16 KiB for certain) as RESOURCE_EXHAUSTED "Stream removed",
# losing the error: there each gets a smaller share.
_TRAILER_MESSAGE = 2 << 10
_TRAILER_TRACEBACK = 2 << 10
_TRAILER_DETAILS = 512


def _dist_version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def local_versions() -> pb.Versions:
  """This process's versions, found without importing jax."""
  return pb.Versions(
      protocol=PROTOCOL_VERSION,
      package=_dist_version("colocated-sidecar"),
      python=platform.python_version(),
      numpy=np.__version__,
      jax=_dist_version("jax"),
  )


def _minor(version: str) -> str:
  return ".".join(version.split(".")[:2])


def version_differences(ours: pb.Versions, theirs: pb.Versions) -> list[str]:
  """What must match between two processes and does not, one line each.

  Protocol and package versions must be equal; Python, numpy and JAX must match
  on major.minor (patch releases do not change array layouts or the codec).
  """
  diffs = []
  for field, exact in (("protocol", True), ("package", True), ("python", False),
                       ("numpy", False), ("jax", False)):
    a, b = getattr(ours, field), getattr(theirs, field)
    if (a != b) if exact else (_minor(str(a)) != _minor(str(b))):
      diffs.append(f"{field}: {a} here, {b} there")
  return diffs


_CODES: tuple[tuple[type[errors.SidecarError], grpc.StatusCode], ...] = (
    (errors.NotRegisteredError, grpc.StatusCode.NOT_FOUND),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.StaleDescriptorError, grpc.StatusCode.INVALID_ARGUMENT),
    # Stored data that fails its checks (ShardsLostError too): gRPC's code for it, not UNKNOWN.
    (errors.CorruptCheckpointError, grpc.StatusCode.DATA_LOSS),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.VersionMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.SessionLostError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def typed(exc: BaseException) -> BaseException:
  """``exc`` as it may cross to a client: a process's own descriptor table or the system's
  full (EMFILE, ENFILE, wherever it was met) as the ResourceExhaustedError it is, never
  ``builtins.OSError`` with the server's traceback; anything else as it is."""
  if (isinstance(exc, OSError) and not isinstance(exc, errors.SidecarError)
      and exc.errno in (errno.EMFILE, errno.ENFILE)):
    return errors.ResourceExhaustedError(
        f"the sidecar has too many files open ({exc.strerror}); a pool tenant's feeds hold "
        "at most its open_files (docs/pool.md): close feeds that are done and try again, or "
        "ask the sidecar's operator to lower the tenants' open_files or raise its "
        "RLIMIT_NOFILE (`ulimit -n`)")
  return exc


def status_code(exc: BaseException) -> grpc.StatusCode:
  exc = typed(exc)
  for cls, code in _CODES:
    if isinstance(exc, cls):
      return code
  return grpc.StatusCode.UNKNOWN


MAX_LOG_MESSAGE = 2 << 10  # of an error's text in a log line: it may quote a request


def for_log(exc: BaseException | str) -> str:
  """``exc``'s message (or a text) cut for a log line (a 64 MiB name once made one 64 MiB
  line)."""
  return truncate(str(exc), MAX_LOG_MESSAGE)


def truncate(text: str, limit: int, *, keep: str = "head") -> str:
  """``text`` cut to at most ``limit`` UTF-8 bytes (and a note saying how much was cut).

  ``keep="tail"`` keeps the end instead, where a traceback says what raised.
  """
  data = text.encode(errors="replace")
  if len(data) <= limit:
    return text
  note = lambda cut: f"[... {cut} of {len(data)} bytes cut ...]"
  room = max(limit - len(note(len(data))) - 1, 0)  # no note is longer than this one
  if keep == "tail":
    kept = data[len(data) - room:].decode(errors="ignore")  # never half a character
    return f"{note(len(data) - len(kept.encode()))} {kept}"
  kept = data[:room].decode(errors="ignore")
  return f"{kept} {note(len(data) - len(kept.encode()))}"


def error_info(exc: BaseException) -> pb.Error:
  """``exc`` as it crosses: our errors by name, user code's with module and traceback.

  A RemoteError (user code's error from a further process, a feed worker's) crosses as
  the error it stands for: its type, message and traceback, not wrapped once more.
  """
  exc = typed(exc)
  if isinstance(exc, errors.RemoteError):
    info = pb.Error(type=exc.remote_type, message=truncate(exc.remote_message, MAX_ERROR_MESSAGE),
                    traceback=truncate(exc.remote_traceback, MAX_ERROR_TRACEBACK, keep="tail"))
    if exc.host_id is not None:
      info.host_id = exc.host_id
    return info
  message = truncate(str(exc), MAX_ERROR_MESSAGE)
  if not isinstance(exc, errors.SidecarError):
    # Each part cut on its own first: a long message (repeated on the last line) must
    # not push the frames out of the traceback.
    parts = (truncate(p.rstrip("\n"), 512) + "\n" for p in traceback.format_exception(exc))
    return pb.Error(type=f"{type(exc).__module__}.{type(exc).__qualname__}", message=message,
                    traceback=truncate("".join(parts), MAX_ERROR_TRACEBACK, keep="tail"))
  info = pb.Error(type=type(exc).__name__, message=message)
  if isinstance(exc, errors.CheckpointWriteError):
    if exc.errno is not None:
      info.errno = exc.errno
    info.path = exc.path or ""
  host_id = getattr(exc, "host_id", None)
  if isinstance(host_id, int):
    info.host_id = host_id
  return info


def remote_error(exc: BaseException) -> errors.RemoteError:
  """User code's ``exc`` as the RemoteError that stands for it: its qualified type, its
  message and its traceback (cut as ``error_info`` cuts them)."""
  info = error_info(exc)
  return errors.RemoteError(info.type, info.message, info.traceback)


def abort(context: grpc.ServicerContext, exc: BaseException) -> None:
  """Ends the RPC with ``exc``'s status and its pb.Error in a trailer, cut to fit."""
  info = error_info(exc)
  info.type, info.message = truncate(info.type, 200), truncate(info.message, _TRAILER_MESSAGE)
  info.traceback = truncate(info.traceback, _TRAILER_TRACEBACK, keep="tail")
  info.path = truncate(info.path, 1024)
  context.set_trailing_metadata(((_ERROR_KEY, info.SerializeToString()),))
  context.abort(status_code(exc), truncate(f"{info.type}: {info.message}", _TRAILER_DETAILS))


def error_from_info(info: pb.Error, *, host: str, host_id: int | None = None
                    ) -> errors.SidecarError:
  """The SidecarError that ``info`` (from ``error_info``) stands for.

  ``host_id``: the host it came from, unless ``info`` names one (a failure another
  process gathered keeps the host where it happened).
  """
  if info.HasField("host_id"):
    host_id = info.host_id
  if info.type == "CheckpointWriteError":
    return errors.CheckpointWriteError(
        info.message, errno=info.errno if info.HasField("errno") else None,
        path=info.path or None, host_id=host_id)
  cls = getattr(errors, info.type, None)
  if isinstance(cls, type) and issubclass(cls, errors.SidecarError) and not issubclass(
      cls, (errors.RemoteError, errors.HostLostError)):
    return cls(info.message)
  if info.type == "HostLostError":
    return errors.HostLostError(info.message, host_id=host_id)
  return errors.RemoteError(info.type, info.message, info.traceback, host_id=host_id)


def error_dict(exc: BaseException) -> dict[str, Any]:
  """``error_info`` in its JSON mapping, for the JSON messages of the Unix socket."""
  return json_format.MessageToDict(error_info(exc), preserving_proto_field_name=True)


def error_from_dict(d: Any, *, host: str, host_id: int | None = None) -> errors.SidecarError:
  """The SidecarError that ``d`` (from ``error_dict``) stands for."""
  try:
    if not isinstance(d, dict):
      raise TypeError(f"a JSON object was expected, got {type(d).__name__}")
    info = json_format.ParseDict(d, pb.Error(), ignore_unknown_fields=True)
    if not info.type:
      raise ValueError("it has no type")
  except (json_format.ParseError, TypeError, ValueError) as e:
    return errors.RemoteError("ProtocolError", f"{host} sent an error that is no pb.Error "
                              f"({truncate(repr(d), 200)}): {e}", host_id=host_id)
  return error_from_info(info, host=host, host_id=host_id)


def versions_dict(v: pb.Versions) -> dict[str, Any]:
  """Versions as plain values, for the JSON attach message of the Unix socket."""
  return {"protocol": v.protocol, "package": v.package, "python": v.python,
          "numpy": v.numpy, "jax": v.jax}


def _metadata_error(e: grpc.RpcError) -> pb.Error | None:
  """The pb.Error in a failed RPC's trailer (see ``abort``), if it has one."""
  # grpc gives metadata as (key, value) tuples; its stubs type them as plain objects.
  metadata = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
  data = dict(metadata or ()).get(_ERROR_KEY)  # type: ignore[arg-type, call-overload]
  if not isinstance(data, bytes):
    return None
  try:
    return pb.Error.FromString(data)
  except DecodeError:
    return None


# A status with no pb.Error (from gRPC itself, or a server that is not a sidecar).
# Reversed, so that the first class of a code in _CODES is the one chosen.
_FALLBACK = {code: cls for cls, code in reversed(_CODES)}


def error_from_rpc(e: grpc.RpcError, *, host: str, host_id: int | None = None
                   ) -> errors.SidecarError:
  """Turns a failed RPC into the matching SidecarError."""
  code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
  if code == grpc.StatusCode.UNAVAILABLE:
    return errors.HostLostError(
        f"sidecar {host} (host {host_id}) is unreachable: {e.details()}", host_id=host_id)
  info = _metadata_error(e)
  if info is not None:
    return error_from_info(info, host=host, host_id=host_id)
  fallback = _FALLBACK.get(code)
  if fallback is not None:  # the sidecar's text may start with the type's name, for grpcurl
    details = (e.details() or "").removeprefix(f"{fallback.__name__}: ")
    return fallback(f"{details} (sidecar {host}"
                    + ("" if host_id is None else f", host {host_id}") + ")")
  return errors.RemoteError(str(code), e.details() or "", host_id=host_id)


def tls_credentials(ca: str | None, cert: str | None, key: str | None
                    ) -> grpc.ChannelCredentials | None:
  """Channel credentials from PEM files (``$SIDECAR_TLS_CA``, ``$SIDECAR_TLS_CLIENT_CERT``,
  ``$SIDECAR_TLS_CLIENT_KEY`` where not given); None when none is given or set. A
  controller's to the sidecars, and a sidecar's to the job's other sidecars.

  Raises:
    InvalidArgumentError: only one of cert and key, or a file that cannot be read.
  """
  ca = ca or env_lib.get(env_lib.TLS_CA)
  cert = cert or env_lib.get(env_lib.TLS_CLIENT_CERT)
  key = key or env_lib.get(env_lib.TLS_CLIENT_KEY)
  if ca is None and cert is None and key is None:
    return None
  if (cert is None) != (key is None):
    raise errors.InvalidArgumentError(
        f"tls_cert and tls_key go together (or {env_lib.TLS_CLIENT_CERT} and "
        f"{env_lib.TLS_CLIENT_KEY}), got {cert!r} and {key!r}")

  def read(path: str | None, what: str) -> bytes | None:
    if path is None:
      return None
    try:
      with open(path, "rb") as f:
        return f.read()
    except OSError as e:
      raise errors.InvalidArgumentError(f"cannot read {what} {path}: {e.strerror}") from None
  return grpc.ssl_channel_credentials(root_certificates=read(ca, "tls_ca"),
                                      private_key=read(key, "tls_key"),
                                      certificate_chain=read(cert, "tls_cert"))
