"""One sidecar's checkpointing: its parts, the threads they share, and who may act where.

The controller drives a save as one sequence of calls, each an rpc of the
``sidecar.v1.Checkpoint`` service (``service.py`` checks the typed requests and calls the
part that does the work; none of them is reachable through ``Call``):

1. ``begin`` (host 0): creates ``<step>.orbax-checkpoint-tmp`` (``writer``).
2. ``stage`` (every host): takes the shards the worker copied into the arena. From
   then on the trainer's arrays are free; this sidecar holds the only copy it needs
   (its RAM tier) and writes its part in a background thread, in stock Orbax's layout.
   A trainer's last part carries the step's plan: once the part is whole here, this host
   takes the step over, and the sidecars commit it among themselves whatever the
   trainers do (``agreements``: ``agreement.Agreements``); then ``commit`` only waits
   for that commit (``taken_over``).
3. ``prepared`` (every host, a step with no plan): waits for that write; returns the
   shards' crc32c.
4. ``commit`` (host 0): writes the manifest (checksums, data position), merges and
   renames: the step becomes visible at once, or not at all.
5. ``committed`` (every host): the RAM tier keeps the newest steps within its budget.

The parts, built and owned here (``close`` joins their threads): ``writer``
(``save.StepWriter``: the calls above, ``abort``, ``delete``), ``tier``
(``ram_tier.RamTier``: the steps (``step.Step``) and replicas, budgets, eviction, expiry
of uncommitted steps, status), ``replicator`` (``replication.Replicator``: ``replicate``
to the replica hosts, ``receive`` from them), ``agreements`` (``agreement.Agreements``:
the steps taken over) and ``reader`` (``read.Reader``). This class keeps only what spans
them: the per-client directories (``open_for``, ``check_client``; what more a client may do is its
``policies.CheckpointPolicy``'s, handed in), a commit's notice to the RAM tier
and replicas (``committed``), and the restore calls that check a path under the roots
first (``roots.py``: every path a call names must lie under one of the sidecar's
checkpoint roots; ``delete`` and ``abort`` remove only step directories a checkpoint wrote).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from sidecar._src.ckptfmt.records import Held, Manifest, ShardRecord
from sidecar._src.core import env as env_lib, errors, paths
from sidecar._src.server import metrics as metrics_lib, policies
from sidecar._src.server.checkpoint import (
  agreement as agreement_lib,
  links as links_lib,
  ownership,
  ram_tier,
  ram_yield,
  read as checkpoint_read,
  replication as checkpoint_replication,
  roots as roots_lib,
  save as checkpoint_save,
)

log = logging.getLogger(__name__)
# "0" makes replicas travel inline over gRPC even to a sidecar on this machine (as to one
# on another machine), instead of through its arena mapped here.
SHM_ENV = env_lib.REPLICA_SHM
# A step staged and written here whose commit never comes (the controller that staged
# it died between staging and committing) is dropped this long after its write ended,
# its arena memory given back. Long enough for the slowest host of a big save.
UNCOMMITTED_ENV = env_lib.UNCOMMITTED_TIMEOUT
UNCOMMITTED_TIMEOUT_S = 600.0
# The threads spawned on this thread inside :meth:`Checkpoints.holding_spawns`, held there
# until its start(); None: outside one.
_HELD: contextvars.ContextVar[list[threading.Thread] | None] = contextvars.ContextVar(
    "sidecar_held_spawns", default=None)
CLOSE_TIMEOUT_S = 10.0  # how long a stopping sidecar waits for its writes in flight


def _seconds(text: str | None, default: float) -> float:
  try:
    value = float(text) if text else default
  except ValueError:
    value = default
  return value if value > 0 else default


class Checkpoints:
  """The checkpoint parts of one sidecar (``writer``, ``tier``, ``replicator``, ``reader``).

  ``policy``: what more a client may do (roots, RAM-tier and storage quotas, turns at the
  storage): a pool's tenants' (``pool/tenant_checks.py``); by default nothing more.
  """

  def __init__(self, host_id: int, *, token: str | None = None,
               replica_token: str | None = None, roots: tuple[str, ...] = (),
               metrics: metrics_lib.Recorder = metrics_lib.OFF,
               replica_credentials: Any = None,
               replica_hosts: links_lib.ReplicaHosts | None = None,
               policy: policies.CheckpointPolicy = policies.OPEN_CHECKPOINTS,
               spare: Callable[[str], int] = lambda tenant: 0):
    self._host_id = host_id
    self.policy = policy
    self._metrics = metrics
    self._roots = roots_lib.Roots(host_id, roots)
    self._path = self._roots.resolve
    self.tier = ram_tier.RamTier(
        host_id, uncommitted_s=_seconds(env_lib.get(UNCOMMITTED_ENV), UNCOMMITTED_TIMEOUT_S),
        group_budget=policy.ram_budget)
    # Its durable copies give way to new work (``reclaim``) and to an operator (``drop_ram``).
    self.yielding = ram_yield.Yielding(self.tier, metrics=metrics, spare=spare)
    self.reader = checkpoint_read.Reader(self.tier, metrics)
    self._links = links_lib.Links(token=token, replica_token=replica_token,
                                     credentials=replica_credentials,
                                     shared_memory=env_lib.get(SHM_ENV) != "0")
    self._closed = threading.Event()
    # With per-client tokens: the checkpoint directories (resolved) each client opened.
    self._opened: dict[str, set[str]] = {}
    self._opened_lock = threading.Lock()
    self._threads: set[threading.Thread] = set()  # writers and replications, see _spawn
    self._threads_lock = threading.Lock()
    # The threads spawned, started by one thread of their own (None: it ends), so that the
    # Stage that spawns its step's writer and commit threads answers without waiting in
    # Thread.start for each to run (0.4-1.4 ms each on a busy host, measured).
    self._to_start: queue.SimpleQueue[threading.Thread | None] = queue.SimpleQueue()
    self._stopping = False  # (the threads lock held) no thread is queued any more
    self._starter = threading.Thread(target=self._start_spawned, name="sidecar-ckpt-starter",
                                     daemon=True)
    self._starter.start()
    self.writer = checkpoint_save.StepWriter(
        host_id, tier=self.tier, roots=self._roots, spawn=self._spawn, metrics=metrics,
        write_turn=policy.write_turn, take_over=lambda own: self.agreements.take_over(own))
    # The steps the sidecars commit among themselves (taken over at their last Stage).
    self.needs_replica_token = replica_token is not None  # for an Agree, where there is one
    self._agree_links = agreement_lib.AgreeLinks(token=token, replica_token=replica_token,
                                                 credentials=replica_credentials)
    self.agreements = agreement_lib.Agreements(
        host_id, tier=self.tier, writer=self.writer, links=self._agree_links,
        hosts=replica_hosts or links_lib.ReplicaHosts(), spawn=self._spawn,
        closed=self._closed)
    self.replicator = checkpoint_replication.Replicator(
        host_id, tier=self.tier, links=self._links, path=self._path, spawn=self._spawn,
        metrics=metrics, hosts=replica_hosts or links_lib.ReplicaHosts(),
        accept=self.accept_replica)
    # Which job holds each directory opened here.
    self.jobs = ownership.Jobs(host_id, open_dir=self._roots.open)
    self._reaper = threading.Thread(target=self._reap, name="sidecar-ckpt-reaper",
                                    daemon=True)
    self._reaper.start()

  def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Stops this host's checkpoint threads and joins them; idempotent.

    A step still being staged is aborted (its trainer's part will not come), a
    replication in flight cancelled; a write whose shards are all here finishes, within
    ``timeout`` s for all of them (one still running then is logged: its step is not
    committed, and a later save's sweep removes it). Then the links to the replica hosts close.
    """
    self._closed.set()
    for own in self.tier.steps():
      own.stop(errors.ClosedError(f"the sidecar of host {self._host_id} is stopping "
                                  f"mid-save of step {own.step}"))
    self.writer.close(errors.ClosedError(f"the sidecar of host {self._host_id} is stopping "
                                         "mid-save"))
    deadline = time.monotonic() + timeout
    with self._threads_lock:
      self._stopping = True  # those spawned from now on start at once
    self._to_start.put(None)  # after those queued: every one is started before it ends
    if self._starter is not threading.current_thread():
      self._starter.join(timeout)
    with self._threads_lock:
      threads = [self._reaper, *self._threads]
    for thread in threads:
      if thread is not threading.current_thread() and thread.ident is not None:
        thread.join(max(deadline - time.monotonic(), 0.0))
      if thread.is_alive():
        log.warning("%s still runs after %.0f s as the sidecar stops", thread.name, timeout)
    self.jobs.close()
    self._links.close()
    self._agree_links.close()

  def _spawn(self, target: Callable[..., None], *args: Any, name: str) -> None:
    """Starts a thread this host owns (the starter thread starts it: this call does not
    wait for it to run); close() joins it."""
    def run() -> None:
      try:
        target(*args)
      finally:
        with self._threads_lock:
          self._threads.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)  # daemon: a safety net
    held = _HELD.get()
    with self._threads_lock:
      self._threads.add(thread)
      if held is not None:  # started by the holder's start(), close() or not
        held.append(thread)
        return
      if not self._stopping:
        self._to_start.put(thread)
        return
    thread.start()  # the starter has ended

  @contextlib.contextmanager
  def holding_spawns(self) -> Iterator[Callable[[], None]]:
    """The threads spawned inside the block, on its thread, start once the ``start()`` it
    gives is called (inside or after it; idempotent), which the holder must call: a
    Stage's step writer and commit, held until the Stage answered
    (``service._threads_after_answer``)."""
    held: list[threading.Thread] = []
    token = _HELD.set(held)

    def start() -> None:
      with self._threads_lock:
        threads, held[:] = held[:], []
        if not self._stopping:
          for thread in threads:
            self._to_start.put(thread)
          return
      for thread in threads:
        thread.start()  # the starter has ended

    try:
      yield start
    finally:
      _HELD.reset(token)

  def _start_spawned(self) -> None:
    """The starter thread: starts each thread spawned, in order, until close(). One the
    system cannot start now (no threads left) is said and tried again until it starts (its
    step needs it: a writer, a commit taken over) or the sidecar stops."""
    while (thread := self._to_start.get()) is not None:
      while True:
        try:
          thread.start()
          break
        except RuntimeError as e:
          log.error("could not start the thread %s (%s); trying again", thread.name, e)
          if self._closed.wait(0.1):
            break

  def _reap(self) -> None:
    # At least every RELEASE_S: a job gone lets go of its directories within it.
    every = min(max(self.tier.uncommitted_s / 4, 0.1), ownership.RELEASE_S)
    while not self._closed.wait(every):
      self.tier.expire_uncommitted()
      self.writer.forget_ended()
      self.jobs.release_gone()
      self.agreements.forget_decided()

  # ---- who may act where, and commits -----------------------------------

  @property
  def host_id(self) -> int:
    return self._host_id

  def accept_replica(self, tenant: str | None, directory: str) -> None:
    """Checks that a replica of ``tenant``'s (as the sending sidecar says) may be held
    here for ``directory``; a pool's sidecar also opens it for that tenant, counting it in
    its RAM-tier group (``policy.replica_owner``). Outside pools every replica is the
    job's: nothing to check."""
    owner = self.policy.replica_owner(tenant, directory)
    if owner is not None:
      self.open_for(owner, directory)

  def open_for(self, client: str, directory: str) -> None:
    """Records that ``client`` opened ``directory``: it may act in it from now on.

    Raises:
      PermissionDeniedError: another client opened it, or a directory inside it or
        holding it (the first to open a directory has it, until the sidecar stops), or
        another client owns it, one above it or one below it on disk (its
        ``roots.OWNER_FILE``, which the first open writes: a restart keeps it), or the
        policy refuses it (a pool tenant's roots).
    """
    self.policy.check_open(self, client, directory)
    resolved = self._path(directory, "directory")
    with self._opened_lock:
      # A reopen (each replica received too) was checked and claimed at its first open.
      if resolved not in self._opened.get(client, ()):
        for other, theirs in self._opened.items():
          if other != client and any(paths.overlap(resolved, d) for d in theirs):
            raise errors.PermissionDeniedError(
                f"checkpoint directory {directory!r:.200} is, holds or lies in one that "
                f"another client opened on host {self._host_id}; with {self.clients_mode()} "
                "each client checkpoints in directories of its own")
        self._claim(client, directory, resolved)
        self._opened.setdefault(client, set()).add(resolved)
    group = self.policy.ram_group(client)
    if group is not None:
      self.tier.set_group(directory, group)

  def _claim(self, client: str, directory: str, resolved: str) -> None:
    """Records ``client`` as the owner of ``resolved`` on disk (``roots.OWNER_FILE``),
    unless another owner is recorded in it, above it or below it: then
    PermissionDeniedError naming that directory, its owner and the fix."""
    root = self._roots.root_of(resolved)
    assert root is not None  # resolve() checked it
    try:  # made and claimed through its descriptor, opened from the root: no symlink
      at = self._roots.open(resolved, make=True)
    except errors.PermissionDeniedError:
      raise
    except OSError:
      return  # not writable: the open says so (StepWriter.open)
    with at:
      found = roots_lib.foreign_owner(resolved, root, client)
      if found is None and roots_lib.claim(resolved, client, at=at) != client:
        found = resolved, roots_lib.owner_of(resolved) or ""
    if found is not None:
      where, owner = found
      how = ("is" if where == resolved else
             "holds" if paths.beneath(where, resolved) else "lies in")
      raise errors.PermissionDeniedError(
          f"checkpoint directory {directory!r:.200} {how} {where!r:.200}, which client "
          f"{owner!r:.100} owns (its {roots_lib.OWNER_FILE} on host {self._host_id}); each "
          f"client checkpoints in directories of its own: choose another directory, or, if "
          f"{owner!r:.100} is done with it, remove {os.path.join(where, roots_lib.OWNER_FILE)!r}")

  @contextlib.contextmanager
  def storage_reserved(self, client: str | None, directory: str, nbytes: int) -> Iterator[None]:
    """Checks (``check_storage``) and reserves ``nbytes`` more of a save by ``client``: the
    block runs the Stage that records them, under the lock the policy's check took, so no
    other part of the client's saves passes the same check meanwhile."""
    with self.policy.storage_reserved(self, client, directory, nbytes):
      yield

  def check_storage(self, client: str | None, directory: str, nbytes: int) -> None:
    """Refuses (``ResourceExhaustedError``) ``nbytes`` more of a save by ``client`` in
    ``directory`` where they would pass its storage quota (the policy's)."""
    self.policy.check_storage(self, client, directory, nbytes)

  def writing(self) -> list[tuple[str, int]]:
    """The steps staged here and not yet written: (tmp directory, bytes staged)."""
    return [(s.tmp_dir, s.nbytes) for s in self.tier.writing()]

  def opened_by(self, client: str) -> set[str]:
    """The directories (resolved) ``client`` opened."""
    with self._opened_lock:
      return set(self._opened.get(client, ()))

  def resolve(self, path: str, name: str) -> str:
    """``path`` resolved, if it lies under a checkpoint root (``roots.Roots.resolve``)."""
    return self._path(path, name)

  def check_client(self, client: str, path: str, name: str) -> None:
    """PermissionDeniedError unless ``path`` lies in a directory ``client`` opened."""
    resolved = self._path(path, name)
    with self._opened_lock:
      mine = self._opened.get(client, set())
    if not any(paths.inside(resolved, d) for d in mine):
      raise errors.PermissionDeniedError(
          f"{name} {path!r:.200} is in no checkpoint directory client {client!r} opened on "
          f"host {self._host_id}; with {self.clients_mode()} a client sees and acts only in "
          "the directories it opened (Controller.checkpointer(directory))")
    self.policy.check_path(client, path, name)

  def clients_mode(self) -> str:
    """How the sidecar names its clients, for messages (a pool's host says its file)."""
    return self.policy.clients_mode() or "per-client tokens (--client-tokens)"

  def committed(self, final_dir: str, manifest: Manifest | None = None) -> list[int]:
    """Marks a step committed; evicts RAM-tier steps beyond the budget. Returns kept steps.

    ``manifest``: a DCP step's, kept with its RAM-tier copy (and replicas held here), so
    that :meth:`info` needs no file of the step.
    """
    self._path(final_dir, "final_dir")
    if manifest is not None:
      self.tier.keep_manifest(final_dir, manifest)
    return self.tier.mark_committed(final_dir)

  def reopened(self, directory: str) -> None:
    """Applies ``directory``'s ``ram_steps``/``ram_budget`` as just (re)opened: a job that
    reopens it with ``ram_steps=0`` frees its RAM-tier copies at once."""
    self.tier.evict(directory)

  # ---- the RAM tier gives way -------------------------------------------

  def reclaim(self, nbytes: int, tenant: str | None = None) -> int:
    """Drops durable RAM-tier copies for ``nbytes`` of new work's arena room
    (``ram_yield.Yielding.reclaim``); returns the bytes let go of."""
    return self.yielding.reclaim(nbytes, tenant)

  def describe_ram(self, client: str | None = None, *, everyone: bool = True) -> str:
    """What the RAM tier holds, per directory, for an error about a full arena that goes
    to ``client``; unless ``everyone`` (the clients share one token), only the directories
    it opened are named, the others' copies summed."""
    if everyone:
      return self.yielding.describe()
    mine = self.opened_by(client) if client else set()
    return self.yielding.describe(lambda d: os.path.realpath(d) in mine)

  def drop_ram(self, directory: str) -> tuple[list[ram_yield.Copy], list[ram_yield.Copy]]:
    """Drops the durable RAM-tier copies of ``directory`` and the directories in it;
    returns those dropped and those kept (not durable yet)."""
    resolved = self._path(directory, "directory")
    return self.yielding.drop(lambda d: paths.inside(d, resolved))

  def release_ram(self, client: str) -> int:
    """Drops the committed RAM-tier steps (own shards and replicas) of the checkpoint
    directories ``client`` opened here: its job left (a pool's ``ram_keep``, or its removal
    from the pool). Their blocks go back as their views die; the durable steps stay.
    Returns how many steps went."""
    mine = {os.path.realpath(d) for d in self.opened_by(client)}
    return self.tier.release(mine)

  def drop_tenant_ram(self, tenant: str) -> tuple[list[ram_yield.Copy], list[ram_yield.Copy]]:
    """Drops the durable RAM-tier copies of the directories ``tenant`` opened here;
    returns those dropped and those kept (not durable yet)."""
    mine = self.opened_by(tenant)
    return self.yielding.drop(lambda d: d in mine)

  # ---- replicas --------------------------------------------------------

  def held(self, directory: str) -> Held:
    """What the RAM tier holds under ``directory``, per committed item: this host's own
    shards and the whole replicas of other hosts' (by source)."""
    self._path(directory, "directory")
    return self.tier.held(directory)

  def forget(self, directory: str, step: int) -> None:
    """Drops a step from this host's RAM tier (its own shards and the replicas held)."""
    self._path(directory, "directory")
    step = roots_lib.as_int(step, "step")
    self.tier.drop([(directory, step)])

  # ---- restore -----------------------------------------------------------

  def info(self, final_dir: str, *, taken_over: bool = False) -> Manifest:
    """The manifest of a committed item (leaves, shard checksums, data position), checked
    (``read.info``): against its own crc32c, and, unless this host's RAM tier holds the
    step (a restore reads it from there, not its files), the item's metadata files
    against it.

    An item stock Orbax wrote has no manifest: then each leaf counts as one shard,
    with no checksum to check.

    ``taken_over``: instead, this host's part of a step it took over, from its RAM tier,
    durable or not (``read.taken_over``): what an in-process rollback restores.
    """
    self._path(final_dir, "final_dir")
    if taken_over:
      return checkpoint_read.taken_over(self.tier.find(final_dir), final_dir,
                                        self.tier.host_id)
    held = self.tier.copies_of(final_dir)
    for copy in held:
      if copy.manifest is not None:
        return copy.manifest  # a DCP step in host memory: its files may be gone
    in_ram = any(copy.committed for copy in held)
    return checkpoint_read.info(final_dir, stored=not in_ram)

  def read(self, final_dir: str, record: ShardRecord, tier: str = "any",
           byte_range: tuple[int, int] | None = None, *, checked: bool = True,
           stored: checkpoint_read.Stored | None = None) -> np.ndarray:
    """The stored shard ``record`` (its manifest's) describes: from the RAM tier (no copy) or
    from storage into the arena, checked against it (``read.Reader.read``).

    ``byte_range=(offset, nbytes)``: only those bytes of a RAM-tier copy's C-order bytes, for a
    client that reads a large shard over gRPC in messages of bounded size. ``stored``: how a
    read from storage is made (a pool tenant's process, ``read.Stored``); None: here.
    """
    self._path(final_dir, "final_dir")
    return self.reader.read(final_dir, record, tier, byte_range, checked=checked,
                            stored=stored)
