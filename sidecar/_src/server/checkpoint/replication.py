"""Replicas of a step's shards: this host sends its own, and holds other hosts'.

``replicate`` (every host, once its part is staged) sends this host's shards of the
step to its replica hosts (``links.ReplicaLink``), on an idle-class thread, while the
write goes on; they are named by host id, their addresses come from this sidecar's own
``--replica-hosts`` (``links.ReplicaHosts``). Each takes them with ``receive`` (the
``Receive`` stream, one per replica) and keeps it as a ``copies.Replica`` (the step's
item, the source host, the shards) in its RAM tier. A replica carries its tenant (the one this
sidecar authenticated); the receiver counts it against that tenant's arena and RAM-tier quota
(``accept``), toward its ``ram_budget``, and it leaves with its step: eviction by
``committed``, ``abort``, ``forget``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import direct_io, records
from sidecar._src.ckptfmt.records import (
  ReplicaHeader,
  ReplicaPiece,
  Replicated,
  ShardRecord,
  Staged,
)
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import (
  copies,
  faults,
  links as links_lib,
  ram_tier,
  step as step_lib,
)
from sidecar._src.user import outputs
from sidecar._src.wire import codec

log = logging.getLogger(__name__)


class Replicator:
  """The replication of one sidecar (``host_id``): the steps it sends, the replicas it takes.

  Args:
    host_id: this sidecar's host.
    tier: its RAM tier, where the staged steps are and the replicas go.
    links: its connections to the replica hosts (the owner closes them).
    path: resolves a path under the checkpoint roots, or raises.
    spawn: starts a thread the owner joins (``spawn(target, *args, name=...)``).
    metrics: where the bytes replicated and the time it took are recorded.
    hosts: where the replica targets are (this sidecar's own configuration).
    accept: checks that a replica of a tenant may be held here (``accept(tenant,
      directory)``), and counts it in the tenant's RAM-tier group.
  """

  def __init__(self, host_id: int, *, tier: ram_tier.RamTier, links: links_lib.Links,
               path: Callable[[Any, str], str], spawn: Callable[..., None],
               metrics: metrics_lib.Recorder,
               hosts: links_lib.ReplicaHosts | None = None,
               accept: Callable[[str | None, str], None] = lambda tenant, directory: None):
    self._host_id = host_id
    self._hosts = hosts or links_lib.ReplicaHosts()
    self._accept = accept
    self._tier = tier
    self._links = links
    self._path = path
    self._spawn = spawn
    self._metrics = metrics

  def replicate(self, final_dir: str, hosts: Sequence[int], timeout: float = 3600.0,
                bandwidth: int | None = None, *, tenant: str | None = None) -> Replicated:
    """Sends this host's staged shards of a step to the sidecars ``hosts`` (host ids of
    ``--replica-hosts``); waits until each holds them.

    The sending runs once per step, on an idle-class thread, whoever waits for it, at
    most ``bandwidth`` bytes per second if given. ``tenant``: the caller's, as this
    sidecar authenticated it; each replica carries it.

    Raises:
      InvalidArgumentError: a host id that is not in ``--replica-hosts`` (or is this host).
    """
    self._path(final_dir, "final_dir")
    targets = [self._hosts.target(h, own=self._host_id) for h in hosts]
    if bandwidth is not None and (not isinstance(bandwidth, int) or bandwidth < 1):
      raise errors.InvalidArgumentError(
          f"bandwidth must be None or bytes per second >= 1, got {bandwidth!r}")
    own = self._tier.step_at(final_dir)
    own.wait_whole(timeout)  # processes sharing this host: wait for them all
    try:
      job, made = own.start_replication(
          lambda: copies.Replication(targets, bandwidth, tenant=tenant))
    except step_lib.StateError:  # not whole (staging, failed before it was), or dropped
      if own.state is step_lib.State.DROPPED:  # since step_at found it: as if not found
        raise errors.InvalidArgumentError(
            f"host {self._host_id} holds step {own.step} at {final_dir!r:.200} no more: its "
            "save was aborted (or its RAM tier let it go) before its replication began; "
            "nothing to replicate") from None
      raise errors.InvalidArgumentError(
          f"step {own.step} is not staged whole on host {self._host_id}; replicate it "
          "after its last part") from None
    if made:
      self._spawn(self._replicate, own, job, name=f"sidecar-replicate-{own.step}")
    if not job.wait(timeout):
      raise errors.DeadlineExceededError(
          f"step {own.step} is still being replicated after {timeout} s")
    if job.error is not None:
      raise errors.HostLostError(
          f"host {self._host_id} could not replicate step {own.step} to hosts "
          f"{[r.host_id for r in job.receivers]}: {job.error}")
    assert job.result is not None
    return job.result

  def _replicate(self, own: step_lib.Step, job: copies.Replication) -> None:
    direct_io.background_thread()
    t0 = time.perf_counter()
    shards = own.staged()
    header = ReplicaHeader(own.directory, own.step, own.final_dir, self._host_id)
    try:
      nbytes = 0
      for receiver in job.receivers:
        nbytes, same_machine = self._links.send(receiver, header, shards, tenant=job.tenant,
                                                cancelled=lambda: job.cancelled,
                                                bandwidth=job.bandwidth)
        how = "shared memory" if same_machine else "gRPC"
        log.info("step %d: %d shards (%s) replicated to host %d over %s in %.2f s",
                 own.step, len(shards), shm.format_size(nbytes), receiver.host_id, how,
                 time.perf_counter() - t0, extra={"step": own.step})
      result = Replicated(tuple(r.host_id for r in job.receivers), len(shards),
                          sum(s.data.nbytes for s in shards), time.perf_counter() - t0)
      self._metrics.checkpoint_bytes("replicated", result.nbytes * len(job.receivers))
      self._metrics.background("replicate", result.seconds)
    except BaseException as e:
      error = e.with_traceback(None)
      e.__context__ = e.__cause__ = None
      log.error("step %d: replicating host %d's shards failed: %s", own.step,
                self._host_id, e, extra={"step": own.step})
      shards.clear()  # the staged blocks stay only as long as the RAM tier keeps them
      job.failed(error)
      return
    shards.clear()
    job.succeeded(result)

  def open_replica(self, header: ReplicaHeader, tenant: str | None = None) -> copies.Replica:
    """A new replica for one stream of another sidecar's shards (``header`` names them,
    ``tenant`` whose they are: the sending sidecar says, checked by ``accept``).

    It replaces one of the same step and source that is not whole (a resent replica
    starts afresh: chunks are counted by bytes, so none may come twice); a whole one it
    replaces only once it is whole itself (``receive``), so a resend that breaks leaves
    the old copy.
    """
    directory, step, final_dir, source = (header.directory, header.step, header.final_dir,
                                          header.source)
    self._path(directory, "header.directory")
    self._path(final_dir, "header.final_dir")
    self._accept(tenant, directory)
    return self._tier.open_replica(directory, step, final_dir, source)

  def receive(self, replica: copies.Replica, blocks: Sequence[Staged],
              piece: ReplicaPiece | None = None, payload: np.ndarray | None = None, *,
              done: bool = False) -> int:
    """Takes shards another sidecar sends (``links.ReplicaLink``) into ``replica``
    (``open_replica``).

    A shard comes whole as an arena block the sender filled (same machine), or inline
    in pieces: ``piece`` says where ``payload``'s bytes go in one shard's, assembled here
    in an arena block. ``done``: the replica is whole. Returns the bytes held.
    """
    step, source = replica.step, replica.source
    self._replica_fault(step)
    for b in blocks:  # whole blocks of our arena
      self._add_shard(replica, b.record, b.data)
    if piece is not None:
      if payload is None or blocks:
        raise errors.InvalidArgumentError(
            "receive: a piece of a shard comes alone, with its bytes as payload")
      key = piece.record.id
      offset, chunk = piece.offset, np.asarray(payload).reshape(-1).view(np.uint8)
      entry = self._tier.replica_piece(replica, key, lambda: outputs.empty(
          piece.record.shape, codec.dtype_of(piece.record.dtype,
                                             f"replica of {key.key_path}")))
      flat = entry[0].reshape(-1).view(np.uint8)
      if not 0 <= offset <= flat.nbytes - chunk.nbytes:
        raise errors.InvalidArgumentError(
            f"receive: chunk at {offset} of {chunk.nbytes} bytes does not fit a shard of "
            f"{flat.nbytes}")
      flat[offset:offset + chunk.nbytes] = chunk
      whole = self._tier.replica_piece_received(replica, key, entry, chunk.nbytes)
      if whole:
        self._add_shard(replica, piece.record, entry[0])
    if done:
      if not self._tier.replica_whole(replica):
        return 0  # aborted or evicted while it came
      log.info("step %d: holding host %d's replica (%d shards, %s)", step, source,
               len(replica.shards), shm.format_size(replica.nbytes), extra={"step": step})
    return replica.nbytes

  def drop_partial(self, replica: copies.Replica) -> None:
    """Forgets ``replica`` if it is not whole, and only it: not a newer stream's."""
    self._tier.discard_partial(replica)

  def _add_shard(self, replica: copies.Replica, record: ShardRecord, data: np.ndarray
                 ) -> None:
    """Adds a whole shard, if it has the crc32c its sender computed (its record's)."""
    key, crc32c = record.id, record.crc32c
    if crc32c is None or records.shard_crc32c(data) != crc32c:
      raise errors.InvalidArgumentError(
          f"receive: shard {[*key.key_path]} {[list(i) for i in key.index]} of host "
          f"{replica.source}'s "
          f"replica of step {replica.step} does not match the crc32c its sender computed "
          f"({crc32c}): the replica is dropped")
    self._tier.add_replica_shard(replica, key, data)

  def _replica_fault(self, step: int) -> None:
    if not faults.armed("replicate", step):
      return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until our own part of the step is committed
      if any(s.step == step and s.committed for s in self._tier.steps()):
        break
      time.sleep(0.02)
    faults.fault("replicate", step)
