"""How a checkpointer keeps its steps, for every framework: :class:`CheckpointOptions`.

``ctl.checkpointer`` (JAX's and the numpy core's), ``sidecar.torch.Checkpointer`` and
``sidecar.torch.StorageWriter`` take the same options and check them here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.core import errors

IF_BUSY = ("wait", "skip")


def _is_int(v: object) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointOptions:
  """How the sidecars keep a checkpointer's steps: on storage, in RAM, on their peers.

  Example::

    options = sidecar.CheckpointOptions(max_to_keep=3, replicas=1, ram_steps=2)
    ckpt = ctl.checkpointer("/ckpt/run1", options=options)
    ckpt = sidecar.torch.Checkpointer("/ckpt/run1", options=options)

  Attributes:
    max_to_keep: the newest steps kept on storage; older ones are deleted once a newer
      one is durable. None: all.
    keep_period: keep also the steps divisible by it (JAX's checkpointer). None: none.
    replicas: other sidecars that also keep each shard in their RAM tier (at most
      hosts - 1; fewer live hosts get fewer, with a warning).
    ram_steps: the newest committed steps each sidecar keeps in its arena (its RAM tier).
    ram_budget: bytes of arena the RAM tier may hold; None: no limit but the arena.
    replica_bandwidth: bytes per second each sidecar sends its replicas at (an int, or
      a size such as ``"500MiB"``, kept as bytes); None: unpaced.
    if_busy: what a save does while the previous is not durable yet: ``"wait"`` for it,
      or ``"skip"`` this save (its handle's futures hold None); every process alike.
    max_failed_saves: how many saves that fail in the background in a row end the run:
      a failed save (a full disk, an I/O error) is logged at once and costs only itself,
      the next save goes on, and the save after this many failures in a row raises the
      first one's error (docs/concepts.md). 1: the first failure is raised by the next
      save, as Orbax's async manager does.
    format: the layout the sidecars write, a registered format's name
      (``ckptfmt/registry.py``: ``"orbax"``, ``"dcp"``); None: the framework's own
      (``"orbax"`` for JAX and numpy trees, ``"dcp"`` for PyTorch). A restore names none:
      a step's format is the one its manifest names.
  """
  max_to_keep: int | None = None
  keep_period: int | None = None
  replicas: int = 0
  ram_steps: int = 1
  ram_budget: int | None = None
  replica_bandwidth: int | str | None = None
  if_busy: str = "wait"
  max_failed_saves: int = 3
  format: str | None = None

  def __post_init__(self) -> None:
    for name in ("max_to_keep", "keep_period"):
      v = getattr(self, name)
      if v is not None and (not _is_int(v) or v < 1):
        raise errors.InvalidArgumentError(
            f"{name} must be None or an int >= 1, got {v!r}")
    if not _is_int(self.replicas) or self.replicas < 0:
      raise errors.InvalidArgumentError(
          f"replicas must be an int >= 0 (other sidecars that keep each shard), got "
          f"{self.replicas!r}")
    if not _is_int(self.ram_steps) or self.ram_steps < 0:
      raise errors.InvalidArgumentError(
          f"ram_steps must be an int >= 0 (0: the RAM tier keeps no step), got "
          f"{self.ram_steps!r}")
    if self.ram_budget is not None and (not _is_int(self.ram_budget) or self.ram_budget < 0):
      raise errors.InvalidArgumentError(
          f"ram_budget must be None or bytes (an int >= 0), got {self.ram_budget!r}")
    bandwidth = self.replica_bandwidth
    if isinstance(bandwidth, str):
      try:
        bandwidth = shm.parse_size(bandwidth)
      except ValueError as e:
        raise errors.InvalidArgumentError(
            f"replica_bandwidth: {e}") from None
      object.__setattr__(self, "replica_bandwidth", bandwidth)
    if bandwidth is not None and (not _is_int(bandwidth) or bandwidth < 1):
      raise errors.InvalidArgumentError(
          f"replica_bandwidth must be None or bytes per second (an int >= 1, or a size such "
          f"as '500MiB'), got {self.replica_bandwidth!r}")
    if self.if_busy not in IF_BUSY:
      raise errors.InvalidArgumentError(
          f"if_busy must be 'wait' or 'skip', got {self.if_busy!r}")
    if not _is_int(self.max_failed_saves) or self.max_failed_saves < 1:
      raise errors.InvalidArgumentError(
          f"max_failed_saves must be an int >= 1 (failed saves in a row that end the run; "
          f"1: the next save raises the first failure), got {self.max_failed_saves!r}")
    if self.format is not None and self.format not in formats_lib.DEFAULT.formats:
      raise errors.InvalidArgumentError(
          f"format must be None (the framework's own) or one of the registered formats "
          f"{formats_lib.DEFAULT.names}, got {self.format!r:.100}")

  def format_for(self, framework: str, *, default: str,
                 extras: tuple[type | None, type | None] = (None, None)) -> str:
    """The format ``framework``'s save writes: ``format``, or the framework's ``default``.

    A framework writes the formats whose extras (``Format.stage_extra``, ``commit_extra``)
    are the ``extras`` it makes: JAX's saves make none (leaves and shards say all), DCP's
    ``StorageWriter`` its ``DcpPart`` and ``DcpCommit``. InvalidArgumentError naming the
    format and those the framework writes otherwise.
    """
    name = self.format or default
    fmt = formats_lib.DEFAULT.get(name)
    if (fmt.stage_extra, fmt.commit_extra) != extras:
      can = [n for n, f in sorted(formats_lib.DEFAULT.formats.items())
             if (f.stage_extra, f.commit_extra) == extras]
      raise errors.InvalidArgumentError(
          f"format {name!r} is not one a {framework} save writes (it needs "
          f"{_extra_names(fmt.stage_extra, fmt.commit_extra)}, the save makes "
          f"{_extra_names(*extras)}); choose one of {can}")
    return name

  @property
  def bandwidth(self) -> int | None:
    """``replica_bandwidth`` in bytes per second (a size given as text is parsed)."""
    assert not isinstance(self.replica_bandwidth, str)
    return self.replica_bandwidth


def _extra_names(*extras: type | None) -> str:
  named = [p.__name__ for p in extras if p is not None]
  return " and ".join(named) if named else "no format extras"


def options_or(options: CheckpointOptions | None, **given: Any) -> CheckpointOptions:
  """``options``, or one made of the keyword arguments ``given`` (a call's own); both
  given (a keyword argument off its default) is an error that names them."""
  made = CheckpointOptions(**given)
  if options is None:
    return made
  if made != CheckpointOptions():
    raise errors.InvalidArgumentError(
        f"give either options=CheckpointOptions(...) or {', '.join(sorted(given))}, not both")
  return options
