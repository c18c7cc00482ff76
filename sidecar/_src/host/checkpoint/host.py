"""The sidecar's half of checkpointing: keep staged shards, persist them, commit, read back.

The controller drives a save in phases, each an rpc of the ``sidecar.v1.Checkpoint``
service (``checkpoint_service.py`` checks the typed requests and calls these methods;
none of them is reachable through ``Call``):

1. ``begin`` (host 0): creates ``<step>.orbax-checkpoint-tmp``.
2. ``stage`` (every host): takes the shards the worker copied into the arena. From
   then on the trainer's arrays are free; this sidecar holds the only copy it needs
   (its RAM tier) and writes its part in a background thread, in stock Orbax's layout.
3. ``prepared`` (every host): waits for that write; returns the shards' crc32c.
4. ``commit`` (host 0): writes the manifest (checksums, data position), merges and
   renames: the step becomes visible at once, or not at all.
5. ``committed`` (every host): the RAM tier keeps the newest steps within its budget.

The concerns live beside this facade, which owns the threads (``close`` joins them):
``checkpoint_save`` (the phases above, the writer, ``abort``, ``delete``),
``ram_tier`` (the records, budgets, eviction, expiry of uncommitted steps, status),
``checkpoint_replication`` (``replicate`` to peers, ``receive`` from them),
``checkpoint_read`` (``read`` from the tier asked, ``info``), ``checkpoint_roots``
(every path a call names must lie under one of the sidecar's checkpoint roots;
``delete`` and ``abort`` remove only step directories a checkpoint wrote) and
``checkpoint_faults`` (fault injection for the crash tests).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sidecar._src.core import env, errors
from sidecar._src.host import metrics as metrics_lib
from sidecar._src.host.checkpoint import (
  peers as replicas_lib,
  ram_tier,
  read as checkpoint_read,
  replication as checkpoint_replication,
  roots as roots_lib,
  save as checkpoint_save,
)
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
# "0" makes replicas travel inline over gRPC even to a peer on this machine (as to one
# on another machine), instead of through the peer's arena mapped here.
SHM_ENV = env.REPLICA_SHM
# A step staged and written here whose commit never comes (the controller that staged
# it died between staging and committing) is dropped this long after its write ended,
# its arena memory given back. Long enough for the slowest host of a big save.
UNCOMMITTED_ENV = env.UNCOMMITTED_TIMEOUT
UNCOMMITTED_TIMEOUT_S = 600.0
CLOSE_TIMEOUT_S = 10.0  # how long a stopping sidecar waits for its writes in flight


def _seconds(text: str | None, default: float) -> float:
  try:
    value = float(text) if text else default
  except ValueError:
    value = default
  return value if value > 0 else default


class CheckpointHost:
  """The checkpoint phases of one sidecar (the ``Checkpoint`` service calls them)."""

  def __init__(self, host_id: int, *, token: str | None = None,
               peer_token: str | None = None, roots: tuple[str, ...] = (),
               metrics: metrics_lib.Recorder = metrics_lib.OFF,
               peer_credentials: Any = None):
    self._host_id = host_id
    self._metrics = metrics
    self._roots = roots_lib.Roots(host_id, roots)
    self._path = self._roots.resolve
    self._tier = ram_tier.RamTier(
        host_id, uncommitted_s=_seconds(env.get(UNCOMMITTED_ENV), UNCOMMITTED_TIMEOUT_S))
    self._reader = checkpoint_read.Reader(self._tier, metrics)
    self._links = replicas_lib.Links(token=token, peer_token=peer_token,
                                     credentials=peer_credentials,
                                     shared_memory=env.get(SHM_ENV) != "0")
    self._closed = threading.Event()
    # With per-client tokens: the checkpoint directories (resolved) each client opened.
    self._opened: dict[str, set[str]] = {}
    self._opened_lock = threading.Lock()
    self._threads: set[threading.Thread] = set()  # writers and replications, see _spawn
    self._threads_lock = threading.Lock()
    self._saver = checkpoint_save.Saver(host_id, tier=self._tier, roots=self._roots,
                                        spawn=self._spawn, metrics=metrics)
    self._replicator = checkpoint_replication.Replicator(
        host_id, tier=self._tier, links=self._links, path=self._path, spawn=self._spawn,
        metrics=metrics)
    self._reaper = threading.Thread(target=self._reap, name="sidecar-ckpt-reaper",
                                    daemon=True)
    self._reaper.start()

  def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Stops this host's checkpoint threads and joins them; idempotent.

    A step still being staged is aborted (its trainer's part will not come), a
    replication in flight cancelled; a write whose shards are all here finishes, within
    ``timeout`` s for all of them (one still running then is logged: its step is not
    committed, and a later save's sweep removes it). Then the links to peers close.
    """
    self._closed.set()
    with self._tier.lock:
      steps = list(self._tier.steps.values())
    for record in steps:
      if record.replication is not None:
        record.replication.cancelled.set()
      if not record.closed and not record.done.is_set():
        record.incoming.put(errors.ClosedError(f"the sidecar of host {self._host_id} is "
                                               f"stopping mid-save of step {record.step}"))
    deadline = time.monotonic() + timeout
    with self._threads_lock:
      threads = [self._reaper, *self._threads]
    for thread in threads:
      if thread is not threading.current_thread():
        thread.join(max(deadline - time.monotonic(), 0.0))
      if thread.is_alive():
        log.warning("%s still runs after %.0f s as the sidecar stops", thread.name, timeout)
    self._links.close()

  def _spawn(self, target: Callable[..., None], *args: Any, name: str) -> None:
    """Starts a thread this host owns: close() joins it."""
    def run() -> None:
      try:
        target(*args)
      finally:
        with self._threads_lock:
          self._threads.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)  # daemon: a safety net
    with self._threads_lock:
      self._threads.add(thread)
    thread.start()

  def _reap(self) -> None:
    while not self._closed.wait(min(max(self._tier.uncommitted_s / 4, 0.1), 30.0)):
      self.expire_uncommitted()

  def expire_uncommitted(self) -> list[int]:
    """Drops the steps written here whose commit has not come in time; returns them."""
    return self._tier.expire_uncommitted()

  def status(self) -> list[pb.CheckpointStatus]:
    """Per directory: the steps in the RAM tier and those still being written."""
    return self._tier.status()

  def usage(self) -> dict[str, int]:
    """Steps and bytes in the RAM tier (own, replicas) and being written, for the metrics."""
    return self._tier.usage()

  # ---- save (checkpoint_save) ---------------------------------------------

  def open(self, directory: str, ram_steps: int = 1, ram_budget: int | None = None,
           sweep: bool = True) -> dict:
    """Checks ``directory`` is writable, sweeps uncommitted steps; returns committed steps."""
    return self._saver.open(directory, ram_steps, ram_budget, sweep)

  def open_for(self, client: str, directory: str) -> None:
    """Records that ``client`` opened ``directory``: it may act in it from now on.

    Raises:
      PermissionDeniedError: another client opened it, or a directory inside it or
        holding it (the first to open a directory has it, until the sidecar stops).
    """
    resolved = self._path(directory, "directory")
    inside = lambda a, b: a == b or a.startswith(b.rstrip(os.sep) + os.sep)
    with self._opened_lock:
      for other, theirs in self._opened.items():
        if other != client and any(inside(resolved, d) or inside(d, resolved) for d in theirs):
          raise errors.PermissionDeniedError(
              f"checkpoint directory {directory!r:.200} is, holds or lies in one that another "
              f"client opened on host {self._host_id}; with per-client tokens "
              "(--client-tokens) each client checkpoints in directories of its own")
      self._opened.setdefault(client, set()).add(resolved)

  def opened_by(self, client: str) -> set[str]:
    """The directories (resolved) ``client`` opened."""
    with self._opened_lock:
      return set(self._opened.get(client, ()))

  def check_client(self, client: str, path: str, name: str) -> None:
    """PermissionDeniedError unless ``path`` lies in a directory ``client`` opened."""
    resolved = self._path(path, name)
    with self._opened_lock:
      mine = self._opened.get(client, set())
    if not any(resolved == d or resolved.startswith(d.rstrip(os.sep) + os.sep) for d in mine):
      raise errors.PermissionDeniedError(
          f"{name} {path!r:.200} is in no checkpoint directory client {client!r} opened on "
          f"host {self._host_id}; with per-client tokens (--client-tokens) a client sees and "
          "acts only in the directories it opened (Controller.checkpointer(directory))")

  def begin(self, directory: str, step: int, format: str = "", owner: str = "") -> str:
    """Creates the step's uncommitted directory (``format="dcp"``: DCP's); returns it."""
    return self._saver.begin(directory, step, format, owner)

  def stage(self, directory: str, step: int, item: str, final_item: str, leaves: list[dict],
            shards: list[dict], last: bool = True, writers: int = 1,
            dcp_part: dict | None = None, owner: str = "") -> int:
    """Takes shards of this host and starts writing them; returns the bytes staged so far.

    ``owner``: the session whose save it is (the first part's); see ``Saver.stage``.
    """
    return self._saver.stage(directory, step, item, final_item, leaves, shards, last,
                             writers=writers, dcp_part=dcp_part, owner=owner)
  def prepared(self, final_item: str, timeout: float = 3600.0) -> list[dict]:
    """Waits for this host's write of the step; returns its shards' checksums."""
    return self._saver.prepared(final_item, timeout)

  def commit(self, item: str, step: int, num_hosts: int, leaves: list[dict],
             checksums: list[dict], data_state: str, whole_step: bool,
             replicas: dict | None = None, dcp_commit: dict | None = None,
             owner: str = "") -> str:
    """On host 0: the manifest, then the checks; with ``whole_step`` also the rename.

    Only ``owner``, the session that staged ``item`` here, commits it.
    """
    return self._saver.commit(item, step, num_hosts, leaves, checksums, data_state,
                              whole_step, replicas, dcp_commit=dcp_commit, owner=owner)

  def committed(self, final_item: str, manifest: dict | None = None) -> list[int]:
    """Marks a step committed; evicts RAM-tier steps beyond the budget. Returns kept steps.

    ``manifest``: a DCP step's, kept with its RAM-tier copy (and replicas held here), so
    that :meth:`info` needs no file of the step.
    """
    self._path(final_item, "final_item")
    if manifest is not None:
      with self._tier.lock:
        held = [self._tier.steps.get(final_item),
                *(r for r in self._tier.replicas.values() if r.item == final_item)]
        for record in held:
          if record is not None:
            record.manifest = manifest
    return self._tier.mark_committed(final_item)

  def abort(self, item: str, final_item: str) -> None:
    """Forgets a step whose save failed; removes its uncommitted files."""
    self._saver.abort(item, final_item)

  def delete(self, directory: str, step: int) -> None:
    """Removes a committed step (max_to_keep), if a checkpoint wrote it."""
    self._saver.delete(directory, step)

  # ---- peer replicas ----------------------------------------------------

  def replicate(self, final_item: str, peers: list[dict], timeout: float = 3600.0,
                bandwidth: int | None = None) -> dict[str, Any]:
    """Sends this host's staged shards of a step to ``peers``; waits until each holds them.

    See :meth:`checkpoint_replication.Replicator.replicate`.
    """
    return self._replicator.replicate(final_item, peers, timeout, bandwidth)

  def open_replica(self, header: dict) -> ram_tier.Replica:
    """A replica record for one stream of a peer's shards, replacing one not whole.

    See :meth:`checkpoint_replication.Replicator.open_replica`.
    """
    return self._replicator.open_replica(header)

  def receive(self, replica: ram_tier.Replica, shards: list[dict], done: bool = False,
              payload: np.ndarray | None = None) -> int:
    """Takes shards a peer sends into ``replica``; returns the bytes held.

    See :meth:`checkpoint_replication.Replicator.receive`.
    """
    return self._replicator.receive(replica, shards, done, payload)

  def drop_partial_replica(self, replica: ram_tier.Replica) -> None:
    """Forgets ``replica`` if it is not whole (its stream broke), and only it: a newer
    stream of the same replica keeps its own."""
    self._replicator.drop_partial(replica)

  def held(self, directory: str) -> dict[str, Any]:
    """What the RAM tier holds under ``directory``, per committed item: this host's own
    shards (``own``) and the whole replicas of its peers' (``replicas``, by source)."""
    self._path(directory, "directory")
    return {"own": self._tier.own(directory), "replicas": self._tier.held_replicas(directory)}

  def forget(self, directory: str, step: int) -> None:
    """Drops a step from this host's RAM tier (its own shards and the replicas held)."""
    self._path(directory, "directory")
    step = roots_lib.as_int(step, "step")
    with self._tier.lock:
      self._tier.drop(directory, step)

  # ---- restore -----------------------------------------------------------

  def info(self, final_item: str) -> dict[str, Any]:
    """The manifest of a committed item (leaves, shard checksums, data position).

    An item stock Orbax wrote has no manifest: then each leaf counts as one shard,
    with no checksum to check.
    """
    self._path(final_item, "final_item")
    with self._tier.lock:
      held = [self._tier.steps.get(final_item),
              *(r for r in self._tier.replicas.values() if r.item == final_item)]
    for record in held:
      if record is not None and record.manifest is not None:
        return record.manifest  # a DCP step in host memory: its files may be gone
    return checkpoint_read.info(final_item)

  def read(self, final_item: str, key_path: list, index: list, crc32c: int | None = None,
           tier: str = "any", part: list | None = None) -> np.ndarray:
    """One stored shard: from the RAM tier (no copy) or from storage into the arena (checked).

    ``part=[offset, nbytes]``: only those bytes of a RAM-tier copy's C-order bytes, for a
    client that reads a large shard over gRPC in messages of bounded size.
    """
    self._path(final_item, "final_item")
    return self._reader.read(final_item, key_path, index, crc32c, tier, part)
