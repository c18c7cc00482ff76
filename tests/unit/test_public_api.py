import pytest

import sidecar

pytestmark = pytest.mark.unit


def test_public_api_is_pinned():
  assert sidecar.__all__ == sorted(sidecar.__all__)
  assert sidecar.__all__ == [
      "AlreadyRegisteredError", "ArenaCapacityError", "AuthenticationError", "BusyError",
      "CheckpointOptions", "CheckpointWriteError", "ClosedError",
      "CorruptCheckpointError", "DeadlineExceededError", "DiscoveryError",
      "FeedOptions", "HostInfo", "HostLostError", "InvalidArgumentError", "NotRegisteredError",
      "PermissionDeniedError", "PipelineContext", "Registry", "RemoteError",
      "ResourceExhaustedError", "SessionLostError", "ShardsLostError", "SidecarError",
      "StaleDescriptorError", "VersionMismatchError", "default_registry", "distributed",
      "elastic", "empty",
      "function", "pipeline", "set_default_registry", "testing",
  ]
  assert sidecar.testing.__all__ == ["LocalCluster"]
  assert sidecar.elastic.__all__ == ["Event", "Regrow", "Retry", "devices", "phase", "retry"]
  assert sidecar.distributed.__all__ == ["LocalPeers", "Peers"]
  for name in sidecar.__all__:
    assert getattr(sidecar, name) is not None
  # How a Controller finds its sidecars: addresses, the environment, a service's file
  # (sidecar.jax.Controller inherits them from the controller core).
  assert [m for m in dir(sidecar.jax.Controller) if m.startswith("from_")] == [
      "from_cluster_file", "from_env"]


def test_every_error_of_the_tree_is_exported():
  """The docs name errors to catch (ShardsLostError, SessionLostError, ...): each is
  ``sidecar.<Name>``, and none is reachable only through ``sidecar._src``."""
  from sidecar._src.core import errors
  tree = sorted(n for n, v in vars(errors).items()
                if isinstance(v, type) and issubclass(v, errors.SidecarError))
  assert [n for n in tree if n not in sidecar.__all__] == []
  assert all(getattr(sidecar, n) is getattr(errors, n) for n in tree)


def test_torch_api_is_pinned():
  import sidecar.torch
  assert sidecar.torch.__all__ == [
      "Checkpointer", "Controller", "DataLoader", "Ranks", "SaveHandle",
      "StorageReader", "StorageWriter", "TorchPeers", "connect", "ranks"]
  for name in sidecar.torch.__all__:
    assert getattr(sidecar.torch, name) is not None
  # One door per name: CheckpointOptions is both frameworks', sidecar's alone.
  assert not hasattr(sidecar.torch, "CheckpointOptions")


def test_jax_api_is_pinned_and_the_root_controller_is_its():
  import sidecar.jax
  assert sidecar.jax.__all__ == [
      "Controller", "JaxPeers", "Worker", "initialize", "is_initialized"]
  for name in sidecar.jax.__all__:
    assert getattr(sidecar.jax, name) is not None
  # One door per name: JAX's classes are sidecar.jax's alone; a name that left the root
  # says where it went.
  for name in ("Controller", "Worker"):
    with pytest.raises(AttributeError, match=f"sidecar.{name} is sidecar.jax.{name}"):
      getattr(sidecar, name)
  assert not hasattr(sidecar.jax, "FeedOptions")
  assert not hasattr(sidecar.distributed, "initialize")


def test_orbax_integration_api_is_pinned():
  import sidecar.orbax
  assert sidecar.orbax.__all__ == [
      "FeedStateHandler", "FeedStateRestore", "FeedStateSave", "SidecarCheckpointHandler",
      "SidecarRestore", "SidecarSave"]
