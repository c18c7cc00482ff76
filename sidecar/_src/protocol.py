"""The wire: generated code, versions, and exceptions <-> gRPC status codes.

This is the only module that imports the code generated from
``protos/sidecar/v1/*.proto``; everything else reaches it as ``protocol.pb``.
"""

from __future__ import annotations

import importlib.metadata
import platform
import traceback
from typing import Any

import grpc
import numpy as np

from sidecar._src import errors
from sidecar.v1 import sidecar_pb2 as pb, sidecar_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]

PROTOCOL_VERSION = 1
SERVICE = "sidecar.v1.Sidecar"
SESSION_KEY = "sidecar-session"
AUTH_KEY = "authorization"
_TYPE_KEY = "sidecar-error-type"
_MESSAGE_KEY = "sidecar-error-message-bin"
_TRACEBACK_KEY = "sidecar-error-traceback-bin"


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
  """What must agree between two processes and does not, one line each.

  Protocol and package versions must be equal; Python, numpy and JAX must agree
  on major.minor (patch releases do not change array layouts or the codec).
  """
  diffs = []
  for field, exact in (("protocol", True), ("package", True), ("python", False),
                       ("numpy", False), ("jax", False)):
    a, b = getattr(ours, field), getattr(theirs, field)
    if (a != b) if exact else (_minor(str(a)) != _minor(str(b))):
      diffs.append(f"{field}: {a} here, {b} there")
  return diffs


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.NotRegisteredError, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.StaleDescriptorError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.VersionMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_code(exc: BaseException) -> grpc.StatusCode:
  for cls, code in _CODES:
    if isinstance(exc, cls):
      return code
  return grpc.StatusCode.UNKNOWN


def error_info(exc: BaseException) -> pb.Error:
  """``exc`` as it crosses: our errors by name, user code's with module and traceback."""
  if not isinstance(exc, errors.SidecarError):
    return pb.Error(type=f"{type(exc).__module__}.{type(exc).__qualname__}", message=str(exc),
                    traceback="".join(traceback.format_exception(exc)))
  return pb.Error(type=type(exc).__name__, message=str(exc))


def abort(context: grpc.ServicerContext, exc: BaseException) -> None:
  """Ends the RPC with ``exc``'s status, type, message and traceback."""
  info = error_info(exc)
  context.set_trailing_metadata((
      (_TYPE_KEY, info.type),
      (_MESSAGE_KEY, info.message.encode()),
      (_TRACEBACK_KEY, info.traceback.encode()),
  ))
  context.abort(status_code(exc), f"{info.type}: {info.message}"[:4000])


def error_from_info(info: pb.Error, *, host: str, host_id: int | None = None
                    ) -> errors.SidecarError:
  """The SidecarError that ``info`` (from ``error_info``) stands for."""
  cls = getattr(errors, info.type, None)
  if isinstance(cls, type) and issubclass(cls, errors.SidecarError) and cls not in (
      errors.RemoteError, errors.HostLostError):
    return cls(info.message)
  if info.type == "HostLostError":
    return errors.HostLostError(info.message, host_id=host_id)
  return errors.RemoteError(info.type, info.message, info.traceback, host_id=host_id)


def error_dict(exc: BaseException) -> dict[str, str]:
  """``error_info`` as plain values, for the JSON messages of the Unix socket."""
  info = error_info(exc)
  return {"type": info.type, "message": info.message, "traceback": info.traceback}


def error_from_dict(d: dict[str, str], *, host: str, host_id: int | None = None
                    ) -> errors.SidecarError:
  return error_from_info(pb.Error(type=d.get("type", ""), message=d.get("message", ""),
                                  traceback=d.get("traceback", "")), host=host, host_id=host_id)


def versions_dict(v: pb.Versions) -> dict[str, Any]:
  """Versions as plain values, for the JSON attach message of the Unix socket."""
  return {"protocol": v.protocol, "package": v.package, "python": v.python,
          "numpy": v.numpy, "jax": v.jax}


def error_from_rpc(e: grpc.RpcError, *, host: str, host_id: int | None = None
                   ) -> errors.SidecarError:
  """Turns a failed RPC into the matching SidecarError."""
  code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
  # grpc gives metadata as (key, value) tuples; its stubs type them as plain objects.
  metadata = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
  meta = dict(metadata or ())  # type: ignore[arg-type]
  name = meta.get(_TYPE_KEY)
  if code == grpc.StatusCode.UNAVAILABLE:
    return errors.HostLostError(
        f"sidecar {host} (host {host_id}) is unreachable: {e.details()}", host_id=host_id)
  if name is not None:
    return error_from_info(pb.Error(
        type=name, message=(meta.get(_MESSAGE_KEY) or b"").decode(errors="replace"),
        traceback=(meta.get(_TRACEBACK_KEY) or b"").decode(errors="replace")),
        host=host, host_id=host_id)
  fallback = {
      grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
      grpc.StatusCode.NOT_FOUND: errors.NotRegisteredError,
      grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
      grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
      grpc.StatusCode.FAILED_PRECONDITION: errors.VersionMismatchError,
      grpc.StatusCode.UNAUTHENTICATED: errors.AuthenticationError,
  }.get(code)
  if fallback is not None:
    return fallback(f"{e.details()} (sidecar {host}, host {host_id})")
  return errors.RemoteError(str(code), e.details() or "", host_id=host_id)
