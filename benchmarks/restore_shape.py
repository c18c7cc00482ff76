"""The shape of one restore: what describes a shard at each stage, the files on its trace.

Run from the repository root: ``python -m benchmarks.restore_shape``. Not run by CI; no
timing. ``benchmarks/save_shape.py`` is its counterpart for a save, and its set-up is
this one's: two in-process sidecars, one trainer in this process, one profiler on both
sides of the gRPC boundary.

Per path, one save, then two traced restores of it, each to its end:

- ``jax``: ``ctl.checkpointer(dir, replicas=1).restore(step, target)`` (Orbax's layout),
  from the RAM tier (the sidecars' arenas), then from storage (after
  ``ckpt.drop_ram_tier()``).
- ``dcp``: ``sidecar.torch.Checkpointer(dir).restore(step, state_dict)`` (DCP's
  ``StorageReader``), the same two.

Per restore it prints:

- the stages a shard's description passes, seen as they run: each function of the
  restore's path (``save_shape.on_save_path``: the checkpoint modules, both sides) called
  with a shard's description, and the type each such argument held (``record:
  ShardRecord``); a key path, an index or a crc32c passed loose shows up by its own name.
- files of ``sidecar/_src`` that ran, on the restore's path and inclusive, as
  ``save_shape`` counts them for a save.

And once: the forms a shard's description takes from the manifest to the read
(:data:`RESTORE_FORMS`), each counted where its definition is still in the source.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import threading
from typing import Any

from benchmarks import save_shape

# The arguments that carry a shard's description (or a piece of one) into a function.
DESCRIBING = frozenset({"record", "records", "shard", "shards", "shard_id", "crc32c", "crc",
                        "kp", "key_path", "index", "stored", "item", "items"})

# The forms a shard's description takes on a restore, from the step's manifest to the
# read of its bytes, each with a pattern that finds its definition in the source (a form
# that goes away drops out of the count). Before issue 65, a restore passed the key path,
# index and crc32c loose and in anonymous tuples from the Restorer down to the read.
RESTORE_FORMS: list[tuple[str, str, str]] = [
    ("Manifest entry", r"^class Manifest\b",
     "ckptfmt/records.py: the manifest file's shards, read by Info (ShardRecord.from_dict)"),
    ("pb.ShardRecord", r"^message ShardRecord\b",
     "protos: Info's shards, and the Read request's record"),
    ("ShardRecord", r"^class ShardRecord\b",
     "ckptfmt/records.py: the shard's one description, manifest to read"),
    ("(index, crc32c) of Restorer", r"list\[tuple\[tuple\[tuple\[int, int\], \.\.\.\], int\]\]",
     "controller/checkpoint/restore.py: a leaf's stored shards (gone: its records)"),
    ("(kp, index, crc) of ShardReads", r"def (?:first|start|read)\(self.*kp: KeyPath, index",
     "controller/checkpoint/restore.py: loose arguments (gone: the record)"),
    ("pb.ShardId + crc32c of a Read", r"^  ShardId shard = 2;",
     "protos: CheckpointReadRequest (gone: its record)"),
    ("ShardId + crc32c of Reader.read", r"def read\(self, final_dir: str, shard: ShardId",
     "server/checkpoint/read.py, checkpoints.py, ckptfmt Format.read (gone: the record)"),
    ("ShardId -> ShardRecord of DCP's reader", r"self\._sums: dict\[ShardId, ShardRecord\]",
     "torch/storage.py: a record looked up, its crc32c passed on (gone: the record)"),
    ("_Form", r"^class _Form\b",
     "controller/checkpoint/restore.py: the dtype and shape a copy must have, derived from "
     "the record (the leaf's where an earlier release's record says none); never sent"),
    ("ShardId of Held", r"^class Held\b",
     "ckptfmt/records.py: which RAM copies a sidecar holds, by id (a look-up, not a "
     "description)"),
    ("distcp.Item of DCP's plan", r"def _index\(final_dir: str",
     "ckptfmt/dcp/format.py: where an item lies in its rank's file, from the manifest's plan "
     "(a read from storage only)"),
]


def count_forms() -> list[tuple[str, str]]:
  """The forms of :data:`RESTORE_FORMS` whose definition is still in the source."""
  root = save_shape.ROOT
  texts = [p.read_text() for p in [*save_shape.SRC.rglob("*.py"),
                                   *(root / "protos").rglob("*.proto")]]
  return [(name, where) for name, pattern, where in RESTORE_FORMS
          if any(re.search(pattern, t, re.M) for t in texts)]


def _kind(value: Any, depth: int = 0) -> str:
  """A value's type as a reader would write it: ``ShardRecord``, ``list[ShardRecord]``."""
  name = type(value).__name__
  if depth > 1 or not isinstance(value, (list, tuple, dict, set, frozenset)) or not value:
    return name
  if isinstance(value, dict):
    k, v = next(iter(value.items()))
    return f"{name}[{_kind(k, depth + 1)}, {_kind(v, depth + 1)}]"
  return f"{name}[{_kind(next(iter(value)), depth + 1)}]"


class RestoreTrace(save_shape.Trace):
  """save_shape's trace, plus the arguments that describe a shard of each call on the
  restore's path."""

  def __init__(self) -> None:
    super().__init__()
    self.stages: dict[str, set[str]] = {}  # "file function" -> {"arg: type"}, first call first
    self._lock = threading.Lock()

  def _profile(self, frame: Any, event: str, arg: Any) -> None:
    super()._profile(frame, event, arg)
    if not self._on or event != "call":
      return
    code = frame.f_code
    name = code.co_filename
    if not name.startswith(self._src) or not save_shape.on_save_path(name[len(self._src):]):
      return
    nargs = code.co_argcount + code.co_kwonlyargcount
    held = {f"{a}: {_kind(frame.f_locals[a])}" for a in code.co_varnames[:nargs]
            if a in DESCRIBING and a in frame.f_locals and frame.f_locals[a] is not None}
    if held:
      with self._lock:
        self.stages.setdefault(f"{name[len(self._src):]} {code.co_qualname}", set()).update(held)

  def __enter__(self) -> RestoreTrace:
    super().__enter__()
    self.stages.clear()
    return self


def report(what: str, trace: RestoreTrace, sources: str) -> None:
  own = sorted(f for f in trace.files if save_shape.on_save_path(f))
  print(f"\n{what}: {sources}")
  print(f"  what describes a shard, stage by stage ({len(trace.stages)} functions, as called):")
  for stage, held in trace.stages.items():
    print(f"    {stage}({', '.join(sorted(held))})")
  print(f"  files on the restore's path: {len(own)} ({len(trace.files)} of sidecar/_src ran)")
  for f in own:
    print(f"    {f}")


def _summary(ckpt: Any) -> str:
  stats = ckpt.last_restore_stats()
  return stats.summary() if stats is not None else "(DCP's reader keeps no RestoreStats)"


def jax_restores(tmp: str, addresses: list[str], trace: RestoreTrace) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import sidecar
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  rows = NamedSharding(mesh, P("data"))
  state = {"w": jax.device_put(jnp.ones((512, 256), jnp.float32), rows),
           "b": jax.device_put(jnp.zeros((256,), jnp.float32), NamedSharding(mesh, P()))}
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)
  with sidecar.jax.Controller(addresses) as ctl, \
      ctl.checkpointer(os.path.join(tmp, "jax"), replicas=1) as ckpt:
    ckpt.save(1, state).durable.result(60)
    ckpt.wait()
    ckpt.restore(1, target)  # warm: imports and first-restore work out of the way
    for tier in ("RAM tier", "storage"):
      if tier == "storage":
        ckpt.drop_ram_tier()
      with trace:
        ckpt.restore(1, target)
      report(f"jax restore from the {tier}", trace, _summary(ckpt))


def dcp_restores(tmp: str, addresses: list[str], trace: RestoreTrace) -> None:
  import torch

  import sidecar
  from sidecar._src.torch import controller as torch_controller
  state = {"w": torch.ones(512, 256), "b": torch.zeros(256), "step": 3}
  with torch_controller.Controller(addresses[:1]) as ctl, \
      sidecar.torch.Checkpointer(os.path.join(tmp, "dcp"), controller=ctl) as ckpt:
    ckpt.save(1, state).durable.result(60)
    ckpt.wait()
    ckpt.restore(1, {"w": torch.zeros(512, 256), "b": torch.ones(256), "step": 0})
    for tier in ("RAM tier", "storage"):
      if tier == "storage":
        ckpt.drop_ram_tier()
      target = {"w": torch.zeros(512, 256), "b": torch.ones(256), "step": 0}
      with trace:
        ckpt.restore(1, target)
      assert torch.equal(target["w"], state["w"]) and target["step"] == 3
      report(f"dcp restore from the {tier}", trace, _summary(ckpt))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--paths", default="jax,dcp", help="which restores to trace: jax, dcp")
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  forms = count_forms()
  print(f"forms of a shard's description per restore, manifest to read: {len(forms)}")
  for name, where in forms:
    print(f"    {name:40s} {where}")
  with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
    trace = RestoreTrace()
    trace.install()
    servers = save_shape._servers(tmp, 2)
    try:
      addresses = [f"127.0.0.1:{s.port}" for s in servers]
      for path in args.paths.split(","):
        {"jax": jax_restores, "dcp": dcp_restores}[path](tmp, addresses, trace)
    finally:
      for s in servers:
        s.stop(grace=0)


if __name__ == "__main__":
  main()
