"""The sidecar's half of checkpointing: keep staged shards, persist them, commit, read back.

The controller drives a save in phases, each a built-in call (``sidecar.ckpt.*``):

1. ``begin`` (host 0): creates ``<step>.orbax-checkpoint-tmp``.
2. ``stage`` (every host): takes the shards the worker copied into the arena. From
   then on the trainer's arrays are free; this sidecar holds the only copy it needs
   (its RAM tier) and writes its part in a background thread, in stock Orbax's layout.
3. ``prepared`` (every host): waits for that write; returns the shards' crc32c.
4. ``commit`` (host 0): writes the manifest (checksums, data position), merges and
   renames: the step becomes visible at once, or not at all.
5. ``committed`` (every host): the RAM tier keeps the newest steps within its budget.

``read`` serves restores: from the RAM tier when this host holds the shard (no copy:
the block itself is leased to the caller), else from storage straight into a new
arena block, checking the crc32c.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import queue
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from sidecar._src import errors, orbax_layout as ol, shm
from sidecar._src.host import outputs
from sidecar._src.protocol import pb

log = logging.getLogger(__name__)
MANIFEST = "sidecar_manifest.json"
# Fault injection for the crash tests: "POINT@STEP" makes this sidecar SIGKILL itself
# there (points: stage, write, prepared, commit), or "slow@STEP" pause 2 s before
# writing. Unset in production.
FAULT_ENV = "SIDECAR_CKPT_FAULT"
# A save's parts come as the trainer copies them (512 MiB in ~0.06 s); a writer that
# waits longer than this for the next one gives up and lets the staged blocks go (the
# trainer died or hung mid-save).
STAGE_TIMEOUT_S = 60.0


def _fault(point: str, step: int) -> None:
  if os.environ.get(FAULT_ENV) == f"{point}@{step}":
    if point == "slow":
      time.sleep(2.0)
      return
    log.warning("fault injection: SIGKILL at %s of step %d", point, step)
    os.kill(os.getpid(), signal.SIGKILL)

Index = tuple[tuple[int, int], ...]


@dataclasses.dataclass
class _Step:
  """One step this sidecar staged: its shards (the RAM tier) and its write's outcome."""
  directory: str
  step: int
  item: str  # the committed item directory: the key of the RAM tier
  shards: dict[tuple[tuple[str | int, ...], Index], np.ndarray]
  nbytes: int
  specs: list[ol.LeafSpec] = dataclasses.field(default_factory=list)
  # Staged shards on their way to the writer: (leaf, Shard), None once all are staged.
  incoming: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
  closed: bool = False  # the last part is staged
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  checksums: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  error: BaseException | None = None
  committed: bool = False
  started: float = dataclasses.field(default_factory=time.monotonic)
  written: int = 0


class CheckpointHost:
  """Built-in ``sidecar.ckpt.*`` functions of one sidecar."""

  def __init__(self, host_id: int):
    self._host_id = host_id
    self._lock = threading.Lock()
    self._steps: dict[str, _Step] = {}  # by committed item directory
    self._ram_steps: dict[str, tuple[int, int | None]] = {}  # directory -> (steps, budget)

  def status(self) -> list[pb.CheckpointStatus]:
    """Per directory: the steps in the RAM tier and those still being written."""
    with self._lock:
      steps = list(self._steps.values())
    out: dict[str, pb.CheckpointStatus] = {}
    for s in sorted(steps, key=lambda s: s.step):
      entry = out.setdefault(s.directory, pb.CheckpointStatus(directory=s.directory))
      if s.committed:
        entry.ram_steps.append(s.step)
      elif not s.done.is_set():
        entry.writing.append(s.step)
        entry.written_bytes += s.written
        entry.total_bytes += s.nbytes
        entry.writing_s = max(entry.writing_s, time.monotonic() - s.started)
    return list(out.values())

  def functions(self) -> dict[str, Callable[..., Any]]:
    return {f"sidecar.ckpt.{name}": getattr(self, name) for name in (
        "open", "begin", "stage", "prepared", "commit", "committed", "abort", "read", "info",
        "ram", "delete")}

  # ---- save --------------------------------------------------------------

  def open(self, directory: str, ram_steps: int = 1, ram_budget: int | None = None,
           sweep: bool = True) -> dict:
    """Checks ``directory`` is writable, sweeps uncommitted steps; returns committed steps.

    ``sweep=False`` where an Orbax CheckpointManager owns the directory's tmp steps.
    """
    path = pathlib.Path(directory)
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
    for tmp in path.glob(f"*{ol.TMP_SUFFIX}") if sweep else ():
      with self._lock:
        in_flight = any(s.directory == directory and not s.done.is_set()
                        for s in self._steps.values())
      if not in_flight:  # a step whose save crashed before its commit
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("removed %s, left by a save that never committed", tmp)
    with self._lock:
      self._ram_steps[directory] = (ram_steps, ram_budget)
    return {"steps": ol.list_steps(directory)}

  def begin(self, directory: str, step: int) -> str:
    return str(ol.create_tmp_step(directory, step))

  def stage(self, directory: str, step: int, item: str, final_item: str, leaves: list[dict],
            shards: list[dict], last: bool = True) -> int:
    """Takes shards of this host (arena views it now holds) and starts writing them.

    A save stages in parts, as the trainer copies (``last`` on the final one): the
    first part starts the writer, each part's shards are written as they arrive.
    ``item`` is the uncommitted item directory to write; ``final_item`` where it will
    be once committed (the RAM tier's key). Returns the bytes staged so far.
    """
    _fault("stage", step)
    with self._lock:
      record = self._steps.get(final_item)
      if record is None or record.done.is_set():
        specs = [ol.spec_from_dict(d) for d in leaves]
        record = self._steps[final_item] = _Step(directory, step, final_item, {}, 0, specs)
        threading.Thread(target=self._write, args=(record, item), daemon=True,
                         name=f"sidecar-ckpt-{step}").start()
      if record.closed:
        raise errors.InvalidArgumentError(f"step {step} on host {self._host_id} is staged already")
      for s in shards:
        leaf, index = int(s["leaf"]), tuple((int(a), int(b)) for a, b in s["index"])
        if not 0 <= leaf < len(record.specs):
          raise errors.InvalidArgumentError(
              f"shard of leaf {leaf}: step {step} has {len(record.specs)} leaves")
        record.shards[(record.specs[leaf].key_path, index)] = s["data"]
        record.nbytes += s["data"].nbytes
        record.incoming.put((leaf, ol.Shard(index, s["data"])))
      if last:
        record.closed = True
        record.incoming.put(None)
      return record.nbytes

  def _write(self, record: _Step, item: str) -> None:
    # The bytes are written and checksummed on idle-class threads (orbax_layout): a
    # save yields the CPU to the training step and feeds wherever they compete.
    t0 = time.perf_counter()
    try:
      _fault("write", record.step)
      _fault("slow", record.step)
      last_log = [time.monotonic()]

      def progress(nbytes: int) -> None:
        record.written += nbytes
        now = time.monotonic()
        if now - last_log[0] >= 1.0:  # rate-limited: one line a second at most
          last_log[0] = now
          log.info("step %d: %s of %s written (%.2f GB/s)", record.step,
                   shm.format_size(record.written), shm.format_size(record.nbytes),
                   record.written / (now - record.started) / 1e9)

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

      sums = ol.write_item_part(item, self._host_id, record.specs, incoming(), progress=progress)
      record.checksums = [{"key_path": list(c.key_path), "index": [list(i) for i in c.index],
                           "nbytes": c.nbytes, "crc32c": c.crc32c} for c in sums]
      seconds = time.perf_counter() - t0
      log.info("step %d: wrote %s in %.2f s (%.2f GB/s)", record.step,
               shm.format_size(record.nbytes), seconds, record.nbytes / max(seconds, 1e-9) / 1e9)
    except BaseException as e:
      record.error = e.with_traceback(None)  # its frames would hold the staged blocks,
      e.__context__ = e.__cause__ = None  # and so would those of the exceptions it chains
      log.error("step %d: writing this host's part failed: %s", record.step, e)
      if not record.closed:  # Its trainer is gone mid-save: nobody will commit or abort it.
        with self._lock:
          if self._steps.get(record.item) is record:
            del self._steps[record.item]
        record.shards.clear()
    finally:
      record.done.set()

  def prepared(self, final_item: str, timeout: float = 3600.0) -> list[dict]:
    record = self._record(final_item)
    if not record.done.wait(timeout):
      raise errors.DeadlineExceededError(
          f"step {record.step} is still being written after {timeout} s")
    if record.error is not None:
      raise errors.InvalidArgumentError(
          f"host {self._host_id} could not write step {record.step}: {record.error}")
    _fault("prepared", record.step)
    return record.checksums

  def commit(self, item: str, step: int, num_hosts: int, leaves: list[dict],
             checksums: list[dict], data_state: str, whole_step: bool) -> str:
    """On host 0: the manifest, then the checks; with ``whole_step`` also the step's rename.

    Without ``whole_step`` (an Orbax handler's item) the CheckpointManager commits.
    """
    manifest = {"format": "colocated-sidecar", "version": 1, "step": step,
                "leaves": leaves, "shards": checksums,
                "data_state": json.loads(data_state) if data_state else None}
    with open(pathlib.Path(item) / MANIFEST, "w") as f:
      json.dump(manifest, f)
      f.flush()
      os.fsync(f.fileno())
    _fault("commit", step)
    specs = [ol.spec_from_dict(d) for d in leaves]
    if whole_step:
      return str(ol.finalize(pathlib.Path(item).parent, specs, num_hosts=num_hosts))
    ol.finalize_item(item, specs, num_hosts=num_hosts)
    return item

  def committed(self, final_item: str) -> list[int]:
    """Marks a step committed; evicts RAM-tier steps beyond the budget. Returns kept steps."""
    with self._lock:
      record = self._steps.get(final_item)
      if record is None:
        return []
      record.committed = True
      keep, budget = self._ram_steps.get(record.directory, (1, None))
      mine = sorted((s for s in self._steps.values()
                     if s.directory == record.directory and s.committed),
                    key=lambda s: s.step, reverse=True)
      kept, used = [], 0
      for s in mine:
        if len(kept) < keep and (budget is None or used + s.nbytes <= budget):
          kept.append(s.step)
          used += s.nbytes
        else:
          del self._steps[s.item]  # its arena blocks go back as its views die
      return sorted(kept)

  def abort(self, item: str, final_item: str) -> None:
    """Forgets a step whose save failed; removes ``item`` (its uncommitted files) once
    written. The controller calls it again with the whole uncommitted step directory
    once every host is done."""
    with self._lock:
      record = self._steps.pop(final_item, None)
    if record is not None:
      if not record.closed:
        record.incoming.put(errors.ClosedError(f"the save of step {record.step} was aborted"))
      record.done.wait(60)
      record.shards.clear()  # the staged blocks go back to the arena
    shutil.rmtree(item, ignore_errors=True)

  def _record(self, final_item: str) -> _Step:
    with self._lock:
      record = self._steps.get(final_item)
    if record is None:
      raise errors.InvalidArgumentError(f"host {self._host_id} has not staged {final_item}")
    return record

  # ---- restore -----------------------------------------------------------

  def ram(self, directory: str) -> dict[str, Any]:
    """What the RAM tier holds under ``directory``: per committed item, its shards."""
    with self._lock:
      steps = [s for s in self._steps.values() if s.directory == directory and s.committed]
    return {s.item: [[list(k), [list(i) for i in index]] for k, index in s.shards]
            for s in steps}

  def info(self, final_item: str) -> dict[str, Any]:
    """The manifest of a committed item (leaves, shard checksums, data position).

    An item stock Orbax wrote has no manifest: then each leaf counts as one shard,
    with no checksum to check.
    """
    try:
      with open(pathlib.Path(final_item) / MANIFEST) as f:
        return json.load(f)
    except FileNotFoundError:
      pass
    try:
      leaves = ol.item_leaves(final_item)
    except FileNotFoundError as e:
      raise errors.InvalidArgumentError(f"cannot restore {final_item}: {e}") from None
    return {"format": "orbax", "leaves": leaves, "data_state": None,
            "shards": [{"key_path": d["key_path"], "index": [[0, n] for n in d["shape"]],
                        "crc32c": None} for d in leaves]}

  def read(self, final_item: str, key_path: list, index: list, crc32c: int | None = None,
           tier: str = "any") -> np.ndarray:
    """One stored shard: from the RAM tier (no copy) or from storage into the arena (checked)."""
    key, idx = tuple(key_path), tuple((int(a), int(b)) for a, b in index)
    if tier in ("any", "ram"):
      with self._lock:
        record = self._steps.get(final_item)
      if record is not None and record.committed and (key, idx) in record.shards:
        return record.shards[(key, idx)]
      if tier == "ram":
        raise errors.InvalidArgumentError(f"host {self._host_id} holds no RAM copy of it")
    data = ol.read_item_shard(final_item, key, idx, allocate=outputs.empty)
    if crc32c is not None and ol.shard_crc32c(data) != crc32c:
      name = ".".join(str(k) for k in key)
      raise errors.CorruptCheckpointError(
          f"{final_item}: array {name!r} shard {[list(i) for i in idx]} does not match its "
          f"crc32c in {MANIFEST}: the file is corrupt or was changed after the save")
    return data

  def delete(self, directory: str, step: int) -> None:
    """Removes a committed step (max_to_keep); the sidecar does the I/O."""
    shutil.rmtree(pathlib.Path(directory) / str(step), ignore_errors=True)
