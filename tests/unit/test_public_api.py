import typing

import pytest

import sidecar

pytestmark = pytest.mark.unit


def test_public_api_is_pinned():
  assert sidecar.__all__ == sorted(sidecar.__all__)
  assert sidecar.__all__ == [
      "AlreadyRegisteredError", "ArenaCapacityError", "AuthenticationError", "BusyError",
      "CheckpointOptions", "CheckpointWriteError", "ClosedError",
      "CorruptCheckpointError", "DataFile", "DataPath", "DataView", "DeadlineExceededError",
      "DiscoveryError", "FeedOptions", "HostInfo", "HostLostError", "InvalidArgumentError",
      "NotFoundError", "NotRegisteredError", "PermissionDeniedError", "PipelineContext",
      "PipelineError", "PipelineInvalidArgumentError", "PipelineNotFoundError",
      "PipelinePermissionDeniedError", "Registry", "RemoteError",
      "ResourceExhaustedError", "SessionLostError", "ShardsLostError", "SidecarError",
      "StaleDescriptorError", "VersionMismatchError", "WrongFormatError", "default_registry",
      "distributed",
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
      "Checkpointer", "Controller", "DataLoader", "Ranks", "Recovery", "SaveHandle",
      "StorageReader", "StorageWriter", "TorchPeers", "connect", "ranks"]
  for name in sidecar.torch.__all__:
    assert getattr(sidecar.torch, name) is not None
  # One door per name: CheckpointOptions is both frameworks', sidecar's alone (the old
  # spelling warns until 0.3.0: test_a_moved_name_warns_with_its_new_spelling_and_works).
  assert "CheckpointOptions" not in dir(sidecar.torch)


def test_jax_api_is_pinned():
  import sidecar.jax
  assert sidecar.jax.__all__ == [
      "Checkpointer", "Controller", "JaxPeers", "Recovery", "Rollback", "SaveHandle", "Worker",
      "initialize", "is_initialized"]
  for name in sidecar.jax.__all__:
    assert getattr(sidecar.jax, name) is not None
  # One door per name: JAX's classes are sidecar.jax's alone.
  assert "FeedOptions" not in dir(sidecar.jax)
  assert "initialize" not in dir(sidecar.distributed)
  assert {"Controller", "Worker"}.isdisjoint(dir(sidecar))


def test_the_object_a_user_saves_with_has_one_public_type_in_both_frameworks():
  import sidecar.jax
  import sidecar.torch
  from sidecar._src.controller.checkpoint import checkpointer, save_run
  # ctl.checkpointer's class is sidecar.jax's; PyTorch's is a class built on it (a call
  # makes one, as when it was a function), so isinstance works against either.
  assert sidecar.jax.Checkpointer is checkpointer.Checkpointer
  assert isinstance(sidecar.torch.Checkpointer, type)
  assert issubclass(sidecar.torch.Checkpointer, sidecar.jax.Checkpointer)
  assert sidecar.jax.SaveHandle is sidecar.torch.SaveHandle is save_run.SaveHandle
  returns = typing.get_type_hints(sidecar.jax.Controller.checkpointer)["return"]
  assert returns is sidecar.jax.Checkpointer



def test_the_public_checkpointer_is_what_users_call():
  """An Orbax manager's doors (save_to, restore_from, mark_committed, key_value) are
  sidecar.orbax's handler's, through controller/checkpoint/checkpointer's module functions;
  their old spellings on the class warn until 0.4.0 (CHANGELOG.md)."""
  import sidecar.jax
  public = {n for n in dir(sidecar.jax.Checkpointer) if not n.startswith("_")}
  assert public - DEPRECATED_METHODS == {
      "all_steps", "close", "data_state", "drop_ram_tier", "last_restore_stats",
      "latest_step", "restore", "save", "save_in_flight", "set_aside", "wait"}



def test_the_next_releases_deprecations_are_in_the_changelog_until_they_go():
  """Issue 65's old spellings (the Orbax manager's doors, ``Retry.record``) work until
  ``NEXT_REMOVED_IN``, and CHANGELOG.md's Unreleased section says how to migrate."""
  import tomllib

  from sidecar._src.core import deprecation
  from tests.support.paths import ROOT
  version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
  as_tuple = lambda v: tuple(int(p) for p in v.split(".")[:3])  # noqa: E731
  assert as_tuple(version) < as_tuple(deprecation.NEXT_REMOVED_IN), version
  changelog = (ROOT / "CHANGELOG.md").read_text()
  unreleased = changelog.split("## Unreleased", 1)[1].split("\n## ", 1)[0]
  assert f"### Deprecated (removed in {deprecation.NEXT_REMOVED_IN})" in unreleased
  assert all(f".{name}(" in unreleased for name in DEPRECATED_METHODS)
  assert "Retry.record(" in unreleased and "Retry.note(" in unreleased


# Public methods that moved behind the Orbax integration: each works until 0.4.0.
DEPRECATED_METHODS = {"key_value", "mark_committed", "restore_from", "save_to"}

# Every public name removed since 0.1.0 (git log -- sidecar/__init__.py sidecar/*.py) and
# its new spelling: each works until 0.3.0, with a DeprecationWarning naming the new one.
MOVED = [
    ("sidecar", "Controller", "sidecar.jax.Controller"),
    ("sidecar", "Worker", "sidecar.jax.Worker"),
    ("sidecar.distributed", "initialize", "sidecar.jax.initialize"),
    ("sidecar.distributed", "is_initialized", "sidecar.jax.is_initialized"),
    ("sidecar.distributed", "JaxPeers", "sidecar.jax.JaxPeers"),
    ("sidecar.jax", "FeedOptions", "sidecar.FeedOptions"),
    ("sidecar.torch", "CheckpointOptions", "sidecar.CheckpointOptions"),
]


def _value(dotted: str):
  import importlib
  module, _, name = dotted.rpartition(".")
  return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module, name, new", MOVED, ids=[f"{m}.{n}" for m, n, _ in MOVED])
def test_a_moved_name_warns_with_its_new_spelling_and_works(module, name, new):
  import importlib
  home = importlib.import_module(module)
  with pytest.warns(DeprecationWarning, match=rf"^{module}\.{name} is deprecated since "
                    rf"0\.2\.0 and goes in 0\.3\.0: use {new}\b") as caught:
    value = getattr(home, name)
  assert value is _value(new)
  assert [w.filename for w in caught] == [__file__]  # points at the user's line
  assert name not in home.__all__  # from sidecar import * takes no moved name


@pytest.mark.parametrize("module, name, new", MOVED, ids=[f"{m}.{n}" for m, n, _ in MOVED])
def test_from_import_of_a_moved_name_warns_once_and_works(module, name, new):
  with pytest.warns(DeprecationWarning, match=f"use {new}") as caught:
    exec(f"from {module} import {name} as value", namespace := {})
  assert namespace["value"] is _value(new)
  assert len(caught) == 1, [str(w.message) for w in caught]


def test_from_sidecar_import_controller_names_the_pytorch_spelling_too():
  import sidecar.jax
  with pytest.warns(DeprecationWarning) as caught:
    from sidecar import Controller
  assert Controller is sidecar.jax.Controller
  assert str(caught[0].message) == (
      "sidecar.Controller is deprecated since 0.2.0 and goes in 0.3.0: use "
      "sidecar.jax.Controller (PyTorch: sidecar.torch.Controller)")
  assert caught[0].filename == __file__


@pytest.mark.parametrize("module", ["sidecar", "sidecar.distributed", "sidecar.jax",
                                    "sidecar.torch", "sidecar.elastic"])
def test_a_name_that_never_was_public_is_a_plain_attribute_error(module):
  import importlib
  import warnings
  home = importlib.import_module(module)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # and no warning
    with pytest.raises(AttributeError, match=f"^module '{module}' has no attribute 'nope'$"):
      home.nope  # noqa: B018
    assert not hasattr(home, "Nope")


def test_orbax_integration_api_is_pinned():
  import sidecar.orbax
  assert sidecar.orbax.__all__ == [
      "FeedStateHandler", "FeedStateRestore", "FeedStateSave", "SidecarCheckpointHandler",
      "SidecarRestore", "SidecarSave"]


def test_the_old_spellings_live_exactly_while_the_version_is_before_their_removal():
  """pyproject.toml's version said the API changed (0.2.0); the release that reaches
  ``REMOVED_IN`` must drop ``MOVED`` (and CHANGELOG.md say so) before this passes again."""
  import tomllib

  from sidecar._src.core import deprecation
  from tests.support.paths import ROOT
  version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
  as_tuple = lambda v: tuple(int(p) for p in v.split(".")[:3])  # noqa: E731
  assert (as_tuple(deprecation.DEPRECATED_IN) <= as_tuple(version)
          < as_tuple(deprecation.REMOVED_IN)), version
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert f"## {version}" in changelog
  assert all(f"{module}.{name}" in changelog and new in changelog
             for module, name, new in MOVED)
