"""colocated-sidecar: data loading and checkpointing on the accelerator hosts."""

from sidecar import distributed, elastic, testing
from sidecar._src.controller.connection import HostInfo
from sidecar._src.controller.controller import Controller
from sidecar._src.errors import (
    AlreadyRegisteredError,
    ArenaCapacityError,
    AuthenticationError,
    ClosedError,
    CorruptCheckpointError,
    DeadlineExceededError,
    DiscoveryError,
    HostLostError,
    InvalidArgumentError,
    NotRegisteredError,
    RemoteError,
    ResourceExhaustedError,
    SidecarError,
    StaleDescriptorError,
    VersionMismatchError,
)
from sidecar._src.host.outputs import empty
from sidecar._src.options import FeedOptions
from sidecar._src.pipeline_context import PipelineContext
from sidecar._src.registry import (
    Registry,
    default_registry,
    function,
    pipeline,
    set_default_registry,
)
from sidecar._src.worker import Worker

__all__ = [
    "AlreadyRegisteredError",
    "ArenaCapacityError",
    "AuthenticationError",
    "ClosedError",
    "Controller",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "DiscoveryError",
    "FeedOptions",
    "HostInfo",
    "HostLostError",
    "InvalidArgumentError",
    "NotRegisteredError",
    "PipelineContext",
    "Registry",
    "RemoteError",
    "ResourceExhaustedError",
    "SidecarError",
    "StaleDescriptorError",
    "VersionMismatchError",
    "Worker",
    "default_registry",
    "distributed",
    "elastic",
    "empty",
    "function",
    "pipeline",
    "set_default_registry",
    "testing",
]
