"""colocated-sidecar: data loading and checkpointing on the accelerator hosts."""

import importlib as _importlib
import typing as _typing

from sidecar._src.core import deprecation as _deprecation

if _typing.TYPE_CHECKING:
  from sidecar import (  # jax, orbax, torch: reached, not in __all__
    distributed,
    elastic,
    jax as jax,
    orbax as orbax,
    testing,
    torch as torch,
  )
  from sidecar._src.controller.checkpoint.options import CheckpointOptions
  from sidecar._src.controller.connection import HostInfo
  from sidecar._src.core.errors import (
    AlreadyRegisteredError,
    ArenaCapacityError,
    AuthenticationError,
    BusyError,
    CheckpointWriteError,
    ClosedError,
    CorruptCheckpointError,
    DeadlineExceededError,
    DiscoveryError,
    HostLostError,
    InvalidArgumentError,
    NotFoundError,
    NotRegisteredError,
    PermissionDeniedError,
    PipelineError,
    PipelineInvalidArgumentError,
    PipelineNotFoundError,
    PipelinePermissionDeniedError,
    RemoteError,
    ResourceExhaustedError,
    SessionLostError,
    ShardsLostError,
    SidecarError,
    StaleDescriptorError,
    VersionMismatchError,
    WrongFormatError,
  )
  from sidecar._src.core.options import FeedOptions
  from sidecar._src.user.data_paths import DataFile, DataPath, DataView
  from sidecar._src.user.outputs import empty
  from sidecar._src.user.pipeline_context import PipelineContext
  from sidecar._src.user.registry import (
    Registry,
    default_registry,
    function,
    pipeline,
    set_default_registry,
  )

# Where each public name lives. Importing ``sidecar`` loads none of them (JAX, gRPC and
# Grain take seconds), so ``sidecar serve``, ``sidecar status`` and ``sidecar launch``
# start without them; the first use of a name imports its module (PEP 562).
# JAX's ``Controller`` and ``Worker`` are ``sidecar.jax``'s, PyTorch's ``sidecar.torch``'s:
# one door each. ``_MOVED``: names that left the root in 0.2.0; each still works until
# 0.3.0, with a DeprecationWarning naming its new spelling (CHANGELOG.md).
_ERRORS = "sidecar._src.core.errors"
_REGISTRY = "sidecar._src.user.registry"
_HOME = {
    "HostInfo": "sidecar._src.controller.connection",
    "PipelineContext": "sidecar._src.user.pipeline_context",
    **{name: "sidecar._src.user.data_paths" for name in ("DataFile", "DataPath", "DataView")},
    "FeedOptions": "sidecar._src.core.options",
    "CheckpointOptions": "sidecar._src.controller.checkpoint.options",
    "empty": "sidecar._src.user.outputs",
    **{name: _ERRORS for name in (
        "AlreadyRegisteredError", "ArenaCapacityError", "AuthenticationError", "BusyError",
        "CheckpointWriteError", "ClosedError", "CorruptCheckpointError", "DeadlineExceededError",
        "DiscoveryError", "HostLostError", "InvalidArgumentError", "NotFoundError",
        "NotRegisteredError", "PermissionDeniedError", "PipelineError",
        "PipelineInvalidArgumentError", "PipelineNotFoundError", "PipelinePermissionDeniedError",
        "RemoteError", "ResourceExhaustedError", "SessionLostError", "ShardsLostError",
        "SidecarError", "StaleDescriptorError", "VersionMismatchError", "WrongFormatError")},
    **{name: _REGISTRY for name in (
        "Registry", "default_registry", "function", "pipeline", "set_default_registry")},
}
_SUBMODULES = ("distributed", "elastic", "testing")
_MOVED = {
    "Controller": _deprecation.Moved("sidecar.jax.Controller",
                                     note="PyTorch: sidecar.torch.Controller"),
    "Worker": _deprecation.Moved("sidecar.jax.Worker"),
}
# Reached as ``sidecar.jax.Controller`` after a bare ``import sidecar``, but left out of
# ``__all__``: ``from sidecar import *`` must not import JAX or torch.
_FRAMEWORKS = ("jax", "orbax", "torch")


def __getattr__(name: str) -> _typing.Any:
  if name not in _SUBMODULES and name not in _FRAMEWORKS and name not in _HOME:
    return _deprecation.resolve(__name__, name, _MOVED)  # AttributeError if never ours
  try:
    if name in _SUBMODULES or name in _FRAMEWORKS:
      return _importlib.import_module(f"sidecar.{name}")
    value = getattr(_importlib.import_module(_HOME[name]), name)
  except ImportError as e:
    from sidecar._src.core import extras
    raise extras.missing(e, f"sidecar.{name}") from e
  globals()[name] = value  # the next access is a plain attribute
  return value


def __dir__() -> list[str]:
  return sorted({*(n for n in globals() if not n.startswith("_")), *__all__})


__all__ = [
    "AlreadyRegisteredError",
    "ArenaCapacityError",
    "AuthenticationError",
    "BusyError",
    "CheckpointOptions",
    "CheckpointWriteError",
    "ClosedError",
    "CorruptCheckpointError",
    "DataFile",
    "DataPath",
    "DataView",
    "DeadlineExceededError",
    "DiscoveryError",
    "FeedOptions",
    "HostInfo",
    "HostLostError",
    "InvalidArgumentError",
    "NotFoundError",
    "NotRegisteredError",
    "PermissionDeniedError",
    "PipelineContext",
    "PipelineError",
    "PipelineInvalidArgumentError",
    "PipelineNotFoundError",
    "PipelinePermissionDeniedError",
    "Registry",
    "RemoteError",
    "ResourceExhaustedError",
    "SessionLostError",
    "ShardsLostError",
    "SidecarError",
    "StaleDescriptorError",
    "VersionMismatchError",
    "WrongFormatError",
    "default_registry",
    "distributed",
    "elastic",
    "empty",
    "function",
    "pipeline",
    "set_default_registry",
    "testing",
]
