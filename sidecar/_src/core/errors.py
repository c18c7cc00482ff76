"""Every error colocated-sidecar raises.

The tree::

    SidecarError                                base of everything below
    ├── AlreadyRegisteredError(ValueError)      a name registered twice
    ├── NotRegisteredError(KeyError)            unknown function/pipeline name (NOT_FOUND)
    ├── NotFoundError(FileNotFoundError)        a data file not there (NOT_FOUND)
    ├── InvalidArgumentError(ValueError)        bad arguments or bytes (INVALID_ARGUMENT)
    │   └── WrongFormatError                    a step in another framework's format
    ├── ResourceExhaustedError                  arena, quota or limit full (RESOURCE_EXHAUSTED)
    │   └── BusyError                           every slot for such rpcs taken: retry
    ├── StaleDescriptorError(ValueError)        an arena block freed or reused since
    ├── CorruptCheckpointError(ValueError)      a stored shard fails its crc32c (DATA_LOSS)
    │   └── ShardsLostError                     shards with no live copy and no valid stored one
    ├── CheckpointWriteError(OSError)           checkpoint bytes not written (ENOSPC, EIO)
    ├── VersionMismatchError                    handshake skew (FAILED_PRECONDITION)
    ├── SessionLostError                        session expired or evicted (FAILED_PRECONDITION)
    ├── AuthenticationError(PermissionError)    missing or bad token (UNAUTHENTICATED)
    ├── PermissionDeniedError(PermissionError)  path outside its roots (PERMISSION_DENIED)
    ├── ArenaCapacityError(MemoryError)         the machine cannot give the arena at start
    ├── RemoteError                             user code raised inside a sidecar
    │   └── PipelineError                       ... a feed's pipeline or a stream's iterable
    │       ├── PipelineNotFoundError(FileNotFoundError)        and a NotFoundError
    │       ├── PipelinePermissionDeniedError(PermissionError)  and a PermissionDeniedError
    │       └── PipelineInvalidArgumentError(ValueError)        and an InvalidArgumentError
    ├── HostLostError(ConnectionError)          a sidecar died or became unreachable
    ├── DeadlineExceededError(TimeoutError)     a call outran its deadline
    ├── DiscoveryError(TimeoutError)            sidecars that never answered discovery
    └── ClosedError(RuntimeError)               use of a closed object

Whatever a pipeline raises reaches its trainer as one type to catch, ``PipelineError``,
naming the pipeline, the host, the cause's type (``remote_type``) and its message: user
code's own exception, and the sidecar's refusals about the pipeline (a path not found or
outside its data roots, a state made from other data). A refusal stays its own kind too
(``PipelineNotFoundError`` is a ``NotFoundError`` and a ``FileNotFoundError``), so
``except sidecar.NotFoundError`` catches a mistyped ``--data`` as well.

Mapping to and from gRPC status codes happens in one place: ``protocol.py``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class SidecarError(Exception):
  """Base class of every error raised by colocated-sidecar."""


class AlreadyRegisteredError(SidecarError, ValueError):
  """A function, pipeline or writer name was registered twice."""


class NotRegisteredError(SidecarError, KeyError):
  """A name is not in the sidecar's registry."""

  def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
    return str(self.args[0]) if self.args else ""


def not_registered(kind: str, name: str, known: Sequence[str], *, where: str = ""
                   ) -> NotRegisteredError:
  """The error for a ``kind`` (``"pipeline"``, ``"function"``) ``name`` that is not
  registered (``where``: " on hosts [1]", say), naming those that are, the closest, and
  how the sidecars come to know one: the ``--import`` of the command that starts them."""
  close = difflib.get_close_matches(name, [k for k in known if k != name], n=1)
  return NotRegisteredError(
      f"no {kind} named {name!r} is registered{where}; registered {kind}s: "
      f"{', '.join(known) or '(none)'}" + (f" (did you mean {close[0]!r}?)" if close else "")
      + f". Register it with @sidecar.{kind} in a module the sidecars import: --import MODULE "
      "on the command that starts them (sidecar launch, sidecar local or sidecar serve), or "
      "LocalCluster(imports=[MODULE])")


class NotFoundError(SidecarError, FileNotFoundError):
  """A file or directory a pipeline was told to read is not there (beneath its tenant's
  data roots, in a pool); the message names the path and, in a pool, the roots."""


class InvalidArgumentError(SidecarError, ValueError):
  """Arguments that do not fit what was asked, or malformed request bytes."""


class WrongFormatError(InvalidArgumentError):
  """A restore asked for a step that is a checkpoint of another format (a PyTorch DCP step
  opened by ``sidecar.jax``, an Orbax one by ``sidecar.torch``); the message names the
  format found and the API that reads it."""


class ResourceExhaustedError(SidecarError):
  """The arena, a quota or a configured limit cannot hold what was asked."""


class BusyError(ResourceExhaustedError):
  """Every slot a sidecar has for rpcs of this kind (calls, streams, checkpoint rpcs) is
  taken: the same request can succeed once those in flight end."""


class StaleDescriptorError(SidecarError, ValueError):
  """An arena descriptor names a block that was freed or reused since."""


class CorruptCheckpointError(SidecarError, ValueError):
  """A stored checkpoint shard does not match the crc32c (or size) recorded at its save."""


class ShardsLostError(CorruptCheckpointError):
  """A restore found shards with no live copy (their hosts and replicas are gone) and no
  valid stored copy; the message names the arrays, the shards and the hosts gone."""


class CheckpointWriteError(SidecarError, OSError):
  """A sidecar could not write a checkpoint's bytes: a full disk (``ENOSPC``), an I/O
  error (``EIO``), a read-only file system.

  Attributes:
    errno: the OS error number (``errno.ENOSPC``), or None where none was given.
    path: the file or directory being written, or None.
    host_id: the host whose sidecar failed, when known.
  """

  def __init__(self, message: str, *, errno: int | None = None, path: str | None = None,
               host_id: int | None = None):
    super().__init__(message)
    self.errno, self.path, self.filename, self.host_id = errno, path, path, host_id

  def __str__(self) -> str:  # OSError's would be its first argument, as this is
    return str(self.args[0]) if self.args else ""

  def __reduce__(self):
    return (_checkpoint_write_error, (str(self), self.errno, self.path, self.host_id))


def _checkpoint_write_error(message: str, errno: int | None, path: str | None,
                            host_id: int | None) -> CheckpointWriteError:
  return CheckpointWriteError(message, errno=errno, path=path, host_id=host_id)


class VersionMismatchError(SidecarError):
  """Controller, worker and sidecar disagree on versions or registries."""


class SessionLostError(SidecarError):
  """The sidecar no longer knows the caller's handshake session (unused too long, or
  evicted): handshake again. A Controller does so once, by itself."""


class AuthenticationError(SidecarError, PermissionError):
  """The sidecar refused the credentials (or their absence)."""


class PermissionDeniedError(SidecarError, PermissionError):
  """The sidecar may not do what was asked: a checkpoint path outside its checkpoint roots,
  a checkpoint call to a sidecar started without any, or a pipeline's path outside its
  tenant's data roots."""


class ArenaCapacityError(SidecarError, MemoryError):
  """The machine, its cgroup or its shared memory cannot give the arena asked for."""


class RemoteError(SidecarError):
  """User code raised inside a sidecar.

  Attributes:
    remote_type: qualified name of the exception type raised remotely.
    remote_message: ``str()`` of the remote exception.
    remote_traceback: the formatted remote traceback.
    host_id: the host whose sidecar raised, when known.
  """

  def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "",
               *, host_id: int | None = None):
    self.remote_type = remote_type
    self.remote_message = remote_message
    self.remote_traceback = remote_traceback
    self.host_id = host_id
    where = "" if host_id is None else f" on host {host_id}"
    text = f"{remote_type}: {remote_message}{where}"
    if remote_traceback:
      text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
    super().__init__(text)

  def __reduce__(self):  # pickles (a user's process pool) with the fields, not the text
    return (_remote_error, (self.remote_type, self.remote_message, self.remote_traceback,
                            self.host_id))


def _remote_error(remote_type: str, message: str, traceback: str, host_id: int | None
                  ) -> RemoteError:
  return RemoteError(remote_type, message, traceback, host_id=host_id)


class PipelineError(RemoteError):
  """A pipeline raised in its sidecar: while it was built, or at a batch (a feed's
  pipeline, or the iterable a ``ctl.stream`` runs); or the sidecar refused it (a path
  not found or outside its data roots, a feed state made from other data: then also of
  that error's kind, ``PipelineNotFoundError`` and its siblings). The sidecar logged it
  at ERROR with its traceback and serves on: the same arguments fail the same way again.

  Attributes (and RemoteError's):
    pipeline: the registered name.
    kind: ``"pipeline"`` (a feed's) or ``"stream"`` (a function a ``ctl.stream`` runs).
    remote_type: the cause's type: ``"builtins.FileNotFoundError"`` for user code's,
      ``"NotFoundError"`` for the sidecar's refusal.
  """

  def __init__(self, pipeline: str, remote_type: str, remote_message: str,
               remote_traceback: str = "", *, host_id: int | None = None,
               kind: str = "pipeline"):
    self.pipeline, self.kind = pipeline, kind
    super().__init__(remote_type, remote_message, remote_traceback, host_id=host_id)
    where = "" if host_id is None else f" on host {host_id}"
    text = (f"{kind} {pipeline!r}{where} raised {remote_type.removeprefix('builtins.')}: "
            f"{remote_message}")
    if remote_traceback:
      text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
    self.args = (text,)

  def __str__(self) -> str:  # OSError's (a PipelineNotFoundError's) would be its own
    return str(self.args[0]) if self.args else ""

  def __reduce__(self):
    return (_pipeline_error, (self.pipeline, self.remote_type, self.remote_message,
                              self.remote_traceback, self.host_id, self.kind, type(self)))

  @staticmethod
  def of(cause: SidecarError, pipeline: str, *, host_id: int | None,
         kind: str = "pipeline") -> PipelineError | None:
    """``cause`` (the sidecar's refusal about ``pipeline``) as the PipelineError of its
    kind (a ``NotFoundError`` as a ``PipelineNotFoundError``); None where it is no
    refusal about a pipeline (an arena full, a token refused)."""
    for refused, cls in _REFUSALS:
      if isinstance(cause, refused):
        return cls(pipeline, type(cause).__name__, str(cause), host_id=host_id, kind=kind)
    return None


def _pipeline_error(pipeline: str, remote_type: str, message: str, traceback: str,
                    host_id: int | None, kind: str,
                    cls: type[PipelineError] = PipelineError) -> PipelineError:
  return cls(pipeline, remote_type, message, traceback, host_id=host_id, kind=kind)


class PipelineNotFoundError(PipelineError, NotFoundError):
  """A path a pipeline was given is not there (the sidecar's ``NotFoundError``, met by
  the pipeline): a PipelineError, a NotFoundError and a FileNotFoundError."""


class PipelinePermissionDeniedError(PipelineError, PermissionDeniedError):
  """A pipeline's path outside its tenant's data roots, or a stream its tenant may not
  run: a PipelineError and a PermissionDeniedError."""


class PipelineInvalidArgumentError(PipelineError, InvalidArgumentError):
  """A pipeline's arguments or state refused by the sidecar (a feed state made from other
  data, a batch larger than the dataset): a PipelineError and an InvalidArgumentError."""


# The sidecar's refusals about a pipeline, each with the PipelineError of its kind.
_REFUSALS: tuple[tuple[type[SidecarError], type[PipelineError]], ...] = (
    (NotFoundError, PipelineNotFoundError),
    (PermissionDeniedError, PipelinePermissionDeniedError),
    (InvalidArgumentError, PipelineInvalidArgumentError))


class HostLostError(SidecarError, ConnectionError):
  """A sidecar died or stopped answering; ``host_id`` names it."""

  def __init__(self, message: str, *, host_id: int | None = None):
    self.host_id = host_id
    super().__init__(message)


class DeadlineExceededError(SidecarError, TimeoutError):
  """A call did not finish before its deadline."""


class DiscoveryError(SidecarError, TimeoutError):
  """Some sidecars did not answer discovery in time; the message lists them."""


class ClosedError(SidecarError, RuntimeError):
  """An object was used after ``close()``."""
