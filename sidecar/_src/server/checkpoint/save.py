"""The save phases on the sidecar: open, begin, stage and its writer, commit, abort, delete.

``stage`` takes shards the worker copied into the arena; from then on the trainer's
arrays are free: this host's RAM tier holds the only copy it needs, and one writer
thread per step (started through ``spawn``, so the owner joins it) writes them as
they arrive, in stock Orbax's layout. ``commit`` writes the manifest, then Orbax's
finalize and rename. ``delete`` and ``abort`` remove only step directories a
checkpoint wrote.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pathlib
import queue
import shutil
import time
import uuid
from collections.abc import Callable

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import (
  commit as ol_commit,
  dcp,
  read as ol_read,
  shards as ol_shards,
  spec as layout,
  write as ol_write,
)
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import dcp_steps, faults, ram_tier, roots as roots_lib
from sidecar._src.server.checkpoint.roots import MANIFEST

log = logging.getLogger(__name__)
# A save's parts come as the trainer copies them (512 MiB in ~0.06 s); a writer that
# waits longer than this for the next one gives up and lets the staged blocks go (the
# trainer died or hung mid-save).
STAGE_TIMEOUT_S = 60.0
DELETING = ".sidecar-deleting-"  # a step being deleted: ``.<step>.sidecar-deleting-<id>``


@dataclasses.dataclass(frozen=True, slots=True)
class WriteEngine:
  """What writes a staged step's bytes, each shard as it comes, and returns their
  checksums: ``item_part`` a part of an Orbax item (``ckptfmt/write.write_item_part``),
  ``dcp_ranks`` the rank files of a DCP step (``dcp_steps.write_ranks``). The step
  writer's seam: a unit test gives it one that records, waits or fails."""
  item_part: Callable[..., list[ol_shards.ShardChecksum]] = ol_write.write_item_part
  dcp_ranks: Callable[..., list[ol_shards.ShardChecksum]] = dcp_steps.write_ranks


class StepWriter:
  """The save phases of one sidecar (``host_id``) over its RAM ``tier``.

  Args:
    host_id: this sidecar's host.
    tier: its RAM tier, where the staged steps go.
    roots: its checkpoint roots; every path a phase names is checked against them.
    spawn: starts a thread the owner joins (``spawn(target, *args, name=...)``).
    metrics: where the bytes staged and written and the write's time are recorded.
    engine: what writes the bytes (the files of stock Orbax's and DCP's layouts).
  """

  def __init__(self, host_id: int, *, tier: ram_tier.RamTier, roots: roots_lib.Roots,
               spawn: Callable[..., None], metrics: metrics_lib.Recorder,
               engine: WriteEngine = WriteEngine()):
    self._host_id = host_id
    self._tier = tier
    self._roots = roots
    self._path = roots.resolve
    self._spawn = spawn
    self._metrics = metrics
    self._engine = engine

  def open(self, directory: str, ram_steps: int = 1, ram_budget: int | None = None,
           sweep: bool = True) -> dict:
    """Checks ``directory`` is writable, sweeps uncommitted steps; returns committed steps.

    ``sweep=False`` where an Orbax CheckpointManager owns the directory's tmp steps.
    """
    path = pathlib.Path(self._path(directory, "directory"))
    try:
      path.mkdir(parents=True, exist_ok=True)
      probe = path / f".sidecar-probe-{uuid.uuid4().hex}"
      probe.write_bytes(b"ok")
      probe.unlink()
    except OSError as e:
      raise errors.InvalidArgumentError(
          f"checkpoint directory {directory!r} is not writable from sidecar host "
          f"{self._host_id}: {e.strerror or e}; give the sidecar write access (on Kubernetes, "
          "mount the same volume in the sidecar container)") from None
    for old in path.glob(f"*{dcp.OLD_SUFFIX}") if sweep else ():
      if dcp.recover(old.with_name(old.name.removesuffix(dcp.OLD_SUFFIX))):
        log.warning("put %s back: an overwrite of it was cut short", old)
    for gone in path.glob(f".*{DELETING}*") if sweep else ():
      shutil.rmtree(gone, ignore_errors=True)  # a delete cut short
    tmps = [*path.glob(f"*{layout.TMP_SUFFIX}"), *path.glob(f"*{dcp.TMP_SUFFIX}")]
    for tmp in tmps if sweep else ():
      with self._tier.lock:
        in_flight = any(s.directory == directory and not s.done.is_set()
                        for s in self._tier.steps.values())
      if not in_flight:  # a step whose save crashed before its commit
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("removed %s, left by a save that never committed", tmp)
    with self._tier.lock:
      self._tier.ram_steps[directory] = (ram_steps, ram_budget)
    # Only numbered directories that hold a checkpoint's marker are steps: an empty
    # ``999/`` (or one being made by hand) is neither listed nor ever deleted.
    return {"steps": [s for s in ol_read.list_steps(directory)
                      if roots_lib.is_checkpoint_dir(path / str(s))
                      or dcp.is_checkpoint(path / str(s))]}

  def begin(self, directory: str, step: int, format: str = "", owner: str = "") -> str:
    """Creates the step's uncommitted directory (anew): ``<directory>/<step>.orbax-checkpoint-tmp``,
    or with ``format="dcp"`` ``<directory>.dcp-checkpoint-tmp`` (a committed checkpoint at
    ``directory`` is replaced at the commit, as DCP overwrites). Refused while another
    session's save of the step is being staged or written (it would remove that save's files)."""
    resolved = self._path(directory, "directory")
    step = roots_lib.as_int(step, "step")
    if format not in ("", dcp_steps.FORMAT):
      raise errors.InvalidArgumentError(f"format must be '' or 'dcp', got {format!r}")
    dcp_tmp = str(dcp.tmp_path(resolved)) if format else ""
    with self._tier.lock:
      busy = [s for s in self._tier.steps.values()
              if not s.done.is_set() and owner not in s.owners
              and (s.tmp_dir == dcp_tmp if format else
                   s.step == step and self._path(s.directory, "directory") == resolved)]
    if busy:
      raise errors.PermissionDeniedError(
          f"begin: step {step} of {directory!r:.200} is being saved by another session on "
          f"host {self._host_id}; wait for that save to end, or save another step")
    if format:  # ``directory`` is the checkpoint's own (DCP's path)
      return str(dcp.create_tmp(directory))
    return str(ol_commit.create_tmp_step(directory, step))

  def _uncommitted(self, tmp_dir: str, name: str) -> tuple[str, str]:
    """``tmp_dir`` (resolved) and where it will be once committed, if ``tmp_dir`` lies in an
    uncommitted step directory (``*.orbax-checkpoint-tmp``) whose step is not committed,
    or is an uncommitted DCP checkpoint (``*.dcp-checkpoint-tmp``; its commit replaces
    a committed one at its path, as DCP overwrites).

    What keeps a save from writing into, or a commit from rewriting, a committed step.
    """
    path = pathlib.Path(self._path(tmp_dir, name))
    root = pathlib.Path(self._roots.root_of(str(path)) or "/")
    dcp_tmp = path.name.endswith(dcp.TMP_SUFFIX)
    tmp = path if dcp_tmp else next((p for p in path.parents if layout.TMP_SUFFIX in p.name),
                                    None)
    # Not in a committed step or item either (Orbax's markers, our manifest, above it).
    inside = next((p for p in (tmp.parents if tmp is not None else ())
                   if p.is_relative_to(root) and roots_lib.has_markers(p)), None)
    if tmp is None or inside is not None:
      raise errors.PermissionDeniedError(
          f"{name} {tmp_dir!r:.200} is not inside an uncommitted step directory "
          f"(*{layout.TMP_SUFFIX}, or *{dcp.TMP_SUFFIX}) outside any committed one; a save "
          "writes only into the step it began, never into a committed one")
    if dcp_tmp:
      return str(path), str(path.with_name(path.name.removesuffix(dcp.TMP_SUFFIX)))
    step_dir = tmp.with_name(tmp.name.split(layout.TMP_SUFFIX)[0])
    if step_dir.exists():
      raise errors.PermissionDeniedError(
          f"{name} {tmp_dir!r:.200}: step {step_dir.name} is committed already ({step_dir}); "
          "nothing writes into or over a committed step")
    return str(path), str(step_dir / path.relative_to(tmp))

  def stage(self, directory: str, step: int, tmp_dir: str, final_dir: str,
            leaves: list[layout.LeafSpec],
            shards: list[dict], last: bool = True, writers: int = 1,
            dcp_part: dict | None = None, owner: str = "") -> int:
    """Takes shards of this host (arena views it now holds) and starts writing them.

    A save stages in parts, as the trainer copies (``last`` on the final one): the
    first part starts the writer, each part's shards are written as they arrive.
    Where ``writers`` trainer processes share this host, the step is whole once each
    has sent its ``last`` part.
    ``tmp_dir`` is the uncommitted item directory to write; ``final_dir`` where it will
    be once committed (the RAM tier's key). Returns the bytes staged so far.

    ``tmp_dir`` must lie in an uncommitted step directory, and ``final_dir`` be where it
    goes; the save belongs to the sessions that staged its parts (``owner``), at most
    ``writers`` of them: a part of another session is refused while it is being written.
    ``dcp_part`` (``{"rank", "items"}``): a step in DCP's layout, this rank's part of it
    (its shards' ``leaf`` numbers its items); ``tmp_dir`` is then the tmp step directory.
    """
    step = roots_lib.as_int(step, "step")
    for value, name in ((directory, "directory"), (final_dir, "final_dir")):
      self._path(value, name)
    tmp_dir, final = self._uncommitted(tmp_dir, "tmp_dir")
    if final != self._path(final_dir, "final_dir"):
      raise errors.InvalidArgumentError(
          f"stage: final_dir {final_dir!r:.200} is not where tmp_dir {tmp_dir!r:.200} goes once "
          f"committed ({final!r:.200})")
    faults.fault("stage", step)
    with self._tier.lock:
      record = self._tier.steps.get(final_dir)
      if record is not None and not record.done.is_set() and (
          record.tmp_dir != tmp_dir
          or (owner not in record.owners and len(record.owners) >= record.writers)):
        raise errors.PermissionDeniedError(
            f"stage: step {record.step} at {final_dir!r:.200} is being saved by another "
            f"session on host {self._host_id}; only the session that began a save stages "
            "its parts")
      if record is None or record.done.is_set():
        specs = [] if dcp_part is not None else list(leaves)
        record = ram_tier.Step(directory, step, final_dir, {}, 0, specs, tmp_dir=tmp_dir,
                               writers=max(writers, 1),
                               format=dcp_steps.FORMAT if dcp_part is not None else "")
        self._tier.steps[final_dir] = record
        self._spawn(self._write, record, tmp_dir, name=f"sidecar-ckpt-{step}")
      if record.closed:
        raise errors.InvalidArgumentError(f"step {step} on host {self._host_id} is staged already")
      if (dcp_part is not None) != (record.format == dcp_steps.FORMAT):
        raise errors.InvalidArgumentError(
            f"step {step} on host {self._host_id} is staged in "
            f"{record.format or 'Orbax'}'s layout; a part in the other came")
      record.owners.add(owner)
      if dcp_part is not None:
        self._stage_dcp(record, dcp_part, shards)
        shards = []
      for s in shards:
        leaf, index = int(s["leaf"]), tuple((int(a), int(b)) for a, b in s["index"])
        if not 0 <= leaf < len(record.specs):
          raise errors.InvalidArgumentError(
              f"shard of leaf {leaf}: step {step} has {len(record.specs)} leaves")
        record.shards[(record.specs[leaf].key_path, index)] = s["data"]
        record.nbytes += s["data"].nbytes
        self._metrics.checkpoint_bytes("staged", s["data"].nbytes)
        record.incoming.put((leaf, ol_shards.Shard(index, s["data"])))
      if last:
        record.lasts += 1
        if record.lasts >= writers:
          record.closed = True
          record.incoming.put(None)
          record.whole.set()
      return record.nbytes

  def _stage_dcp(self, record: ram_tier.Step, part: dict, shards: list[dict]) -> None:
    """Takes one rank's part of a DCP step; the lock is held."""
    rank = roots_lib.as_int(part["rank"], "dcp.rank")
    items = record.dcp_items.setdefault(rank, dcp_steps.items_from_dicts(part["items"]))
    for s in shards:
      number = int(s["leaf"])
      if not 0 <= number < len(items):
        raise errors.InvalidArgumentError(
            f"shard of item {number}: rank {rank} of step {record.step} has {len(items)} items")
      key = ((items[number].fqn,), items[number].index)
      record.shards[key] = s["data"]
      record.nbytes += s["data"].nbytes
      self._metrics.checkpoint_bytes("staged", s["data"].nbytes)
      record.incoming.put(((rank, number), s["data"]))

  def _write(self, record: ram_tier.Step, tmp_dir: str) -> None:
    # The bytes are written and checksummed on idle-class threads (ckptfmt/write.py): a
    # save yields the CPU to the training step and feeds wherever they compete.
    t0 = time.perf_counter()
    try:
      faults.fault("write", record.step)
      faults.fault("slow", record.step)
      last_log = [time.monotonic()]

      def progress(nbytes: int) -> None:
        faults.fault("enospc", record.step)
        record.written += nbytes
        self._metrics.checkpoint_bytes("written", nbytes)
        now = time.monotonic()
        if now - last_log[0] >= 1.0:  # rate-limited: one line a second at most
          last_log[0] = now
          log.info("step %d: %s of %s written (%.2f GB/s)", record.step,
                   shm.format_size(record.written), shm.format_size(record.nbytes),
                   record.written / (now - record.started) / 1e9, extra={"step": record.step})

      def incoming():
        while True:
          try:
            shard = record.incoming.get(timeout=STAGE_TIMEOUT_S)
          except queue.Empty:
            raise errors.DeadlineExceededError(
                f"step {record.step}: no part staged for {STAGE_TIMEOUT_S:g} s; the trainer "
                "stopped mid-save") from None
          if shard is None:
            return
          if isinstance(shard, BaseException):
            raise shard
          yield shard

      if record.format == dcp_steps.FORMAT:
        record.checksums = self._engine.dcp_ranks(tmp_dir, record.dcp_items, incoming(),
                                                  host_id=self._host_id, progress=progress)
      else:
        sums = self._engine.item_part(tmp_dir, self._host_id, record.specs, incoming(),
                                      progress=progress)
        record.checksums = [dataclasses.replace(c, host=self._host_id) for c in sums]
      seconds = time.perf_counter() - t0
      self._metrics.phase("write", seconds)
      log.info("step %d: wrote %s in %.2f s (%.2f GB/s)", record.step,
               shm.format_size(record.nbytes), seconds, record.nbytes / max(seconds, 1e-9) / 1e9,
               extra={"step": record.step})
    except BaseException as e:
      record.error = e.with_traceback(None)  # its frames would hold the staged blocks,
      e.__context__ = e.__cause__ = None  # and so would those of the exceptions it chains
      log.error("step %d: writing this host's part failed: %s", record.step, e,
                extra={"step": record.step})
      if not record.closed:  # Its trainer is gone mid-save: nobody will commit or abort it.
        with self._tier.lock:
          if self._tier.steps.get(record.final_dir) is record:
            del self._tier.steps[record.final_dir]
        record.shards.clear()
    finally:
      record.finished = time.monotonic()
      record.done.set()
      record.whole.set()

  def prepared(self, final_dir: str, timeout: float = 3600.0
               ) -> list[ol_shards.ShardChecksum]:
    self._path(final_dir, "final_dir")
    record = self._tier.record(final_dir)
    if not record.done.wait(timeout):
      raise errors.DeadlineExceededError(
          f"step {record.step} is still being written after {timeout} s")
    if record.error is not None:
      raise write_failure(self._host_id, record.step, final_dir, record.error)
    faults.fault("prepared", record.step)
    return record.checksums

  def commit(self, tmp_dir: str, step: int, num_hosts: int, leaves: list[layout.LeafSpec],
             checksums: list[ol_shards.ShardChecksum], data_state: str, whole_step: bool,
             replicas: dict | None = None, dcp_commit: dict | None = None,
             owner: str = "") -> str:
    """On host 0: the manifest, then the checks; with ``whole_step`` also the step's rename.

    Without ``whole_step`` (an Orbax handler's item) the CheckpointManager commits.
    ``replicas``: which peers hold each host's replicas (``{host: [peers]}``), recorded
    so that a restore that finds shards lost can say which hosts are gone. Only the
    session that staged ``tmp_dir`` here (``owner``) commits it, once it is written, and
    only into an uncommitted step.
    ``dcp_commit`` (``{"metadata", "file_sizes", "plan_json"}``): a step in DCP's layout,
    whose tmp directory ``tmp_dir`` is.
    """
    step = roots_lib.as_int(step, "step")
    tmp_dir, _ = self._uncommitted(tmp_dir, "tmp_dir")
    with self._tier.lock:
      record = next((s for s in self._tier.steps.values() if s.tmp_dir == tmp_dir), None)
    if (record is None or owner not in record.owners or record.step != step
        or record.committed):
      raise errors.PermissionDeniedError(
          f"commit: tmp_dir {tmp_dir!r:.200} is not a step {step} this session staged on host "
          f"{self._host_id}; a session commits only the save it began")
    if not record.done.is_set() or record.error is not None:
      raise errors.InvalidArgumentError(
          f"commit: step {step} at {tmp_dir!r:.200} is not written on host {self._host_id} "
          f"({'still writing' if record.error is None else record.error}); wait for prepared")
    if dcp_commit is not None:
      if not tmp_dir.endswith(dcp.TMP_SUFFIX):
        raise errors.InvalidArgumentError(
            f"tmp_dir {tmp_dir!r:.200} is not an uncommitted DCP step directory "
            f"(*{dcp.TMP_SUFFIX})")
      faults.fault("commit", step)
      return dcp_steps.commit(tmp_dir, step=step, metadata=dcp_commit["metadata"],
                              file_sizes=dcp_commit["file_sizes"],
                              plan_json=dcp_commit["plan_json"], checksums=checksums,
                              data_state=data_state, replicas=replicas)
    if whole_step:  # the rename acts on tmp_dir's parent, the tmp step directory
      parent = self._path(str(pathlib.Path(tmp_dir).parent), "tmp_dir's step directory")
      if not parent.endswith(layout.TMP_SUFFIX):
        raise errors.InvalidArgumentError(
            f"tmp_dir {tmp_dir!r:.200} is not in an uncommitted step directory "
            f"(*{layout.TMP_SUFFIX})")
    manifest = {"format": "colocated-sidecar", "version": 1, "step": step,
                "leaves": [layout.spec_to_dict(s) for s in leaves],
                "shards": [c.to_dict() for c in checksums],
                "data_state": json.loads(data_state) if data_state else None}
    if replicas:
      manifest["replicas"] = {str(h): [int(p) for p in peers] for h, peers in replicas.items()}
    try:
      with open(pathlib.Path(tmp_dir) / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    except (FileNotFoundError, NotADirectoryError) as e:
      raise errors.InvalidArgumentError(
          f"commit: tmp_dir {tmp_dir!r:.200} is not a directory this sidecar staged and wrote "
          f"({e.strerror}); stage and prepare a step before committing it") from None
    faults.fault("commit", step)
    if whole_step:
      return str(ol_commit.finalize(pathlib.Path(tmp_dir).parent, leaves, num_hosts=num_hosts))
    ol_commit.finalize_item(tmp_dir, leaves, num_hosts=num_hosts)
    return tmp_dir

  def abort(self, tmp_dir: str, final_dir: str) -> None:
    """Forgets a step whose save failed; removes ``tmp_dir`` (its uncommitted files) once
    written. The controller calls it again with the whole uncommitted step directory
    once every host is done. ``tmp_dir`` must be an uncommitted step directory
    (``*.orbax-checkpoint-tmp``) or lie in one: nothing else is removed."""
    path = self._path(tmp_dir, "tmp_dir")
    self._path(final_dir, "final_dir")
    root = self._roots.root_of(path)
    assert root is not None
    if not any(part.endswith((layout.TMP_SUFFIX, dcp.TMP_SUFFIX))
               for part in pathlib.Path(path).relative_to(root).parts):
      raise errors.InvalidArgumentError(
          f"abort: tmp_dir {tmp_dir!r:.200} is not an uncommitted step directory "
          f"(*{layout.TMP_SUFFIX}) "
          "nor inside one; abort removes only a save's uncommitted files")
    with self._tier.lock:
      record = self._tier.steps.pop(final_dir, None)
      for key in [k for k in self._tier.replicas if k[0] == final_dir]:
        del self._tier.replicas[key]
    if record is not None:
      if record.replication is not None:
        record.replication.cancelled.set()
      if not record.closed:
        record.incoming.put(errors.ClosedError(f"the save of step {record.step} was aborted"))
      record.whole.set()
      record.done.wait(60)
      record.shards.clear()  # the staged blocks go back to the arena
    shutil.rmtree(path, ignore_errors=True)

  def delete(self, directory: str, step: int) -> None:
    """Removes a committed step (max_to_keep); the sidecar does the I/O.

    Only a step directory a checkpoint wrote goes (Orbax's markers or the manifest in
    it or its items); anything else is refused.
    """
    self._path(directory, "directory")
    step = roots_lib.as_int(step, "step")
    if step < 0:
      raise errors.InvalidArgumentError(f"step must be a non-negative int, got {step}")
    target = pathlib.Path(self._path(str(pathlib.Path(directory) / str(step)), "step directory"))
    if not target.is_dir():
      return  # gone already
    if not roots_lib.is_checkpoint_dir(target):
      raise errors.InvalidArgumentError(
          f"delete: {target} is not a checkpoint step directory (no {MANIFEST} nor Orbax's "
          "_CHECKPOINT_METADATA in it or its items); delete removes only steps a checkpoint "
          "wrote")
    # Renamed away first: a delete cut short leaves no half step under a step's name.
    gone = target.with_name(f".{target.name}{DELETING}{uuid.uuid4().hex[:8]}")
    os.rename(target, gone)
    shutil.rmtree(gone, ignore_errors=True)


def write_failure(host_id: int, step: int, final_dir: str, e: BaseException) -> errors.SidecarError:
  """The error of a host's part of ``step`` that could not be written: an OSError (a full
  disk, an I/O error) is CheckpointWriteError with its errno, file and host; our own
  errors keep their kind."""
  if isinstance(e, errors.SidecarError):
    return e
  if isinstance(e, OSError):
    path = os.fsdecode(e.filename) if e.filename is not None else final_dir
    name = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    return errors.CheckpointWriteError(
        f"host {host_id} could not write step {step}: {e.strerror or e}"
        + (f" ({name})" if name else "") + f" writing {path}; make room there (or save to "
        "another directory), then save again", errno=e.errno, path=path, host_id=host_id)
  return errors.InvalidArgumentError(f"host {host_id} could not write step {step}: {e}")
