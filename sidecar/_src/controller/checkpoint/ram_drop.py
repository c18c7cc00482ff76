"""Dropping RAM-tier copies on request: an operator's or a job's, over the ``DropRamTier`` rpc.

A sidecar keeps the newest committed steps of each directory in its arena (the RAM tier)
for fast restores; they give way by themselves to new work that needs the room. This
drops them at once: a directory's (and those of the directories in it) or a tenant's.
Only durable copies go; a step not committed yet stays and is listed in ``kept``.
``Controller.drop_ram_tier`` and ``Checkpointer.drop_ram_tier`` call it, and so does
``sidecar ram-tier drop``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import grpc

from sidecar._src.arena import shm
from sidecar._src.controller.connection import Connection
from sidecar._src.core import errors
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import ckpt_pb


@dataclasses.dataclass(frozen=True, slots=True)
class RamTierSteps:
  """Steps of one directory in one sidecar's RAM tier, and their bytes."""
  host: int
  directory: str
  steps: tuple[int, ...]
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class RamTierDrop:
  """What a drop let go of (``dropped``: durable steps) and kept (not durable yet)."""
  dropped: tuple[RamTierSteps, ...] = ()
  kept: tuple[RamTierSteps, ...] = ()

  @property
  def nbytes(self) -> int:
    """The bytes of the copies dropped, on every sidecar."""
    return sum(s.nbytes for s in self.dropped)

  def describe(self) -> str:
    """One line per directory and host, for a person."""
    lines = [f"host {s.host}: dropped {s.directory} step{'s' if len(s.steps) > 1 else ''} "
             f"{', '.join(map(str, s.steps))} ({shm.format_size(s.nbytes)})"
             for s in self.dropped]
    lines += [f"host {s.host}: kept {s.directory} step{'s' if len(s.steps) > 1 else ''} "
              f"{', '.join(map(str, s.steps))} ({shm.format_size(s.nbytes)}): not durable "
              "yet (being written or waiting for its commit)" for s in self.kept]
    return "\n".join(lines) or "no RAM-tier copies to drop"


def request(directory: str | None, tenant: str | None) -> ckpt_pb.DropRamTierRequest:
  """The rpc's request; InvalidArgumentError unless exactly one of them is given."""
  if (directory is None) == (tenant is None) or not (directory or tenant):
    raise errors.InvalidArgumentError(
        f"name a directory or a tenant to drop the RAM-tier copies of (one of them), got "
        f"directory={directory!r:.200}, tenant={tenant!r:.100}")
  return ckpt_pb.DropRamTierRequest(directory=directory or "", tenant=tenant or "")


def from_pb(host: int, response: ckpt_pb.DropRamTierResponse) -> RamTierDrop:
  """One sidecar's answer as a :class:`RamTierDrop`."""
  steps = lambda items: tuple(RamTierSteps(host, s.directory, tuple(s.steps), s.nbytes)
                              for s in items)
  return RamTierDrop(dropped=steps(response.dropped), kept=steps(response.kept))


def merged(drops: list[RamTierDrop]) -> RamTierDrop:
  """Several sidecars' answers as one."""
  return RamTierDrop(dropped=tuple(s for d in drops for s in d.dropped),
                     kept=tuple(s for d in drops for s in d.kept))


def drop(conns: Iterable[tuple[int, Any]], req: ckpt_pb.DropRamTierRequest, *,
         timeout: float) -> RamTierDrop:
  """Sends ``req`` to every connection (``(host id, connection)``: its ``checkpoint``
  stub, ``metadata`` and ``address``) at once; the answers merged, or the first error
  raised. Two sidecars may give one host id (pool sidecars started by hand): each is asked."""
  futures = [(h, c, c.checkpoint.DropRamTier.future(req, timeout=timeout, metadata=c.metadata))
             for h, c in conns]
  out = []
  for h, c, f in futures:
    try:
      out.append(from_pb(h, f.result()))
    except grpc.RpcError as e:
      raise protocol.error_from_rpc(e, host=c.address, host_id=h) from None
  return merged(out)


def drop_at(addresses: list[str], req: ckpt_pb.DropRamTierRequest, *, token: str | None,
            timeout: float) -> RamTierDrop:
  """Sends ``req`` to the sidecars at ``addresses`` (``sidecar ram-tier drop``): a
  handshake with each (``token``; TLS where ``$SIDECAR_TLS_CA`` says), then the rpc."""
  conns: list[Connection] = []
  try:
    for address in addresses:
      conns.append(Connection(address, token=token, timeout=timeout,
                              credentials=protocol.tls_credentials(None, None, None)))
    return drop([(c.info.host_id, c) for c in conns], req, timeout=timeout)
  finally:
    for conn in conns:
      try:
        conn.leave().result(timeout=timeout)
      except Exception:  # noqa: BLE001 - gone, or older than Leave: its session expires there
        pass
      conn.close()
