"""The shape of one save: files on its trace, the trainer's threads, forms of a shard, plug tests.

Run from the repository root: ``python -m benchmarks.save_shape``. Not run by CI; no timing.
A restore's counterpart is ``benchmarks/restore_shape.py``.

Two in-process sidecars (``server.server.Server``, as tests/server's ``make_server``), one
trainer in this process, so that one profiler sees both sides of the gRPC boundary. One
warm-up save, then one traced save per path:

- ``jax``: ``ctl.checkpointer(dir, replicas=1).save(step, state)`` (the key-value path,
  Orbax's layout), traced from the call until ``durable`` and ``replicated`` resolve and
  the checkpointer's threads are joined (``ckpt.wait()``).
- ``dcp``: ``sidecar.torch.Checkpointer(dir, replicas=1)``'s save (DCP's hooks), the same.

Per path it prints two counts of files, each a set of distinct ``sidecar/_src`` files whose
functions ran during the save (``sys.setprofile`` and ``threading.setprofile``: every
thread); a file counts once, whichever side and thread ran it:

- files, inclusive: every such file, the save's own code and every RPC's infrastructure
  it goes through (the sidecar's admission, limits, leases, tenants, metrics, the
  arena, env, addresses, codecs, goodput, ...), split into the sidecar's (``server/``),
  the trainer's (``controller/``, ``jax/``, ``torch/``, ``arena/``, ``streams/``) and
  the shared lower layers (``core/``, ``wire/``, ``ckptfmt/``, ``user/``).
- files on the save's path: of those, the checkpoint code a reader follows through a
  save (:data:`SAVE_PATH_FOLDERS`, :data:`SAVE_PATH_MODULES`; listed): every module of
  ``controller/checkpoint/``, ``ckptfmt/`` (the formats, both of them) and
  ``server/checkpoint/``; and the modules
  elsewhere whose concept is checkpointing: ``controller/framework.py`` (what a
  framework hands a save), ``jax/checkpoint.py``, ``jax/framework.py``,
  ``jax/orbax_handler.py``, DCP's ``torch/checkpointer.py``, ``torch/storage.py``,
  ``torch/metadata.py``, ``torch/framework.py`` (``jax/framework.py``'s counterpart), and
  ``wire/checkpoint_wire.py``. Not on it, though they run: the modules a save shares
  with every RPC or with the feeds (``controller/peers.py``, ``controller/sidecars.py``,
  ``controller/connection.py``, ``torch/controller.py``, ``torch/tensors.py``,
  ``arena/``, ``core/``, ``server/`` outside ``server/checkpoint/``, the rest of
  ``wire/``). Issue 56 asked for at most 30 on a JAX save's path.
- trainer threads: the distinct threads that ran the checkpoint core
  (``controller/checkpoint/``) or a framework's adapter (``jax/``, ``torch/``) during the
  save, by name: the caller's, a finisher, a stager, DCP's executor; gRPC's own threads,
  which run the trainer's future callbacks, are counted apart.

And once: ``isinstance`` checks on a plug (``Driver``, ``KeyValueDriver``,
``DcpDriver``, ``Framework``, ``Coordination`` and their subclasses, grepped in
``sidecar/_src``), and the forms a shard's description takes from ``save()`` to the
manifest: the types and tuples this module lists (:data:`FORMS`), each counted where its
definition is still found in the source (a form that goes away drops out of the count), and
apart from them the carriers of a shard's data beside its record (:data:`CARRIERS`), which
count as forms only where they declare a field that describes the shard.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys
import tempfile
import threading
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "sidecar" / "_src"

# A class restates a shard when its body declares one of these as a field of its own.
_RESTATED = r"(?:key_path|index|dtype|shape|leaf|shard|crc32c)"


def _restates(cls: str) -> str:
  """A pattern that finds class ``cls`` if its body declares a field that describes a shard
  (two-space indented ``name: type`` lines; a docstring's attributes are indented more)."""
  return rf"^class {cls}\b[^\n]*\n(?:(?:  [^\n]*)?\n)*?  {_RESTATED}: "


# The forms a JAX save's shard description takes, in order, each with a pattern that finds
# its definition (or its making) in sidecar/_src. Issue 56 counted 11 at 26bb3d2, 9 before
# its shard record; a form that goes away drops out of the count, one that comes back is
# counted again.
FORMS: list[tuple[str, str, str]] = [
    ("SaveShard", r"^class SaveShard\b",
     "controller/framework.py: a framework's shard (where it lies, before a host is chosen; "
     "gone: the adapter makes the ShardRecord, a LocalShard carries it)"),
    ("ShardCopy restating the shard", _restates("ShardCopy"),
     "controller/checkpoint/staging.py: the copy's plan"),
    ("ShardRecord", r"^class ShardRecord\b",
     "ckptfmt/records.py: the shard's one description, plan to manifest"),
    ("pb.ShardRecord", r"^message ShardRecord\b", "protos: its message"),
    ("StagedShard", r"^class StagedShard\b", "ckptfmt/records.py: a shard in a staging.Lot"),
    ("pb.StagedShard", r"^message StagedShard\b", "protos: the wire message"),
    ("(ShardId, Any) of Numbering.take", r"def take\(self.*ShardId, Any",
     "ckptfmt/format.py: the format's numbering"),
    ("(rank, StagedShard)", r"tuple\[int, StagedShard\]", "ckptfmt/dcp: DCP's numbered item"),
    ("NumberedShard", r"^class NumberedShard\b",
     "ckptfmt/records.py: what every format's numbering returns (DCP's rank a field)"),
    ("(ShardId, ndarray) in replication", r"tuple\[ShardId, np\.ndarray\]",
     "server/checkpoint/replication.py"),
    ("(Index, ndarray)", r"tuple\[Index, np\.ndarray\]", "ckptfmt/orbax/write.py"),
    ("ReplicaBlock / ReplicaPiece restating the shard",
     f"{_restates('ReplicaBlock')}|{_restates('ReplicaPiece')}",
     "ckptfmt/records.py: a replica's shard"),
    ("ShardChecksum", r"^class ShardChecksum\b", "ckptfmt/records.py: a written shard"),
    ("pb.ShardChecksum", r"^message ShardChecksum\b", "protos: its message"),
    ("pb.DcpItem", r"^message DcpItem\b",
     "protos: a DCP item described again beside its record at a Stage (gone: each item is "
     "its record, distcp.Item.of_record)"),
    ("DcpPart's items", r"^  items: tuple\[Item\b",
     "ckptfmt/dcp/parts.py: a rank's items, sent with its first Stage (gone: their count)"),
    ("Manifest entry", r"^class Manifest\b", "ckptfmt/records.py: the manifest's shards"),
]
# What carries a shard's data beside its record and describes nothing itself: not forms
# (each is counted in FORMS above, or here as a form, the day it restates the shard).
CARRIERS: list[tuple[str, str]] = [
    ("LocalShard", "controller/framework.py: a framework's record (no host yet), data, device"),
    ("Staged", "ckptfmt/records.py: a record and its bytes (the sidecar's arena view)"),
    ("ShardCopy", "controller/checkpoint/staging.py: a record, its data and arena block"),
    ("ReplicaPiece", "ckptfmt/records.py: a record and where some of its bytes go"),
]

# A save's own path (see the module): folders whose every module is checkpointing, and
# the checkpoint modules of other folders.
SAVE_PATH_FOLDERS = ("controller/checkpoint/", "ckptfmt/", "server/checkpoint/")
SAVE_PATH_MODULES = frozenset({
    "controller/framework.py", "jax/checkpoint.py", "jax/framework.py", "jax/orbax_handler.py",
    "torch/checkpointer.py", "torch/storage.py", "torch/metadata.py", "torch/framework.py",
    "wire/checkpoint_wire.py"})


def on_save_path(rel: str) -> bool:
  """Whether ``rel`` (a path under sidecar/_src) is on a save's own path."""
  return rel.startswith(SAVE_PATH_FOLDERS) or rel in SAVE_PATH_MODULES


TRAINER = ("controller/", "jax/", "torch/", "arena/worker.py")
SAVING = ("controller/checkpoint/", "jax/", "torch/")  # a thread of a save runs these
PLUGS = ("Driver", "KeyValueDriver", "DcpDriver", "Framework", "JaxFramework",
         "TorchFramework", "Coordination", "PeersCoordination", "DcpCoordination")


def count_forms() -> list[tuple[str, str]]:
  """The forms of :data:`FORMS` whose definition is still in the source."""
  texts = [p.read_text() for p in [*SRC.rglob("*.py"), *(ROOT / "protos").rglob("*.proto")]]
  found = []
  for name, pattern, where in FORMS:
    rx = re.compile(pattern, re.M)
    if any(rx.search(t) for t in texts):
      found.append((name, where))
  return found


def carriers() -> list[tuple[str, str, bool]]:
  """The :data:`CARRIERS` still defined: name, where, and whether it restates the shard."""
  texts = [p.read_text() for p in SRC.rglob("*.py")]
  out = []
  for name, where in CARRIERS:
    if any(re.search(rf"^class {name}\b", t, re.M) for t in texts):
      out.append((name, where, any(re.search(_restates(name), t, re.M) for t in texts)))
  return out


def plug_isinstance() -> list[str]:
  """Lines of ``sidecar/_src`` that test a plug's type."""
  rx = re.compile(r"isinstance\([^,]+,\s*\(?[^)]*\b(" + "|".join(PLUGS) + r")\b")
  out = []
  for p in sorted(SRC.rglob("*.py")):
    for n, line in enumerate(p.read_text().splitlines(), 1):
      if rx.search(line):
        out.append(f"{p.relative_to(SRC)}:{n}: {line.strip()}")
  return out


class Trace:
  """Files of sidecar/_src that ran, and the threads that ran trainer code, while on."""

  def __init__(self) -> None:
    self.files: set[str] = set()
    self.threads: dict[tuple[int, str], set[str]] = {}  # (ident, name): trainer files run
    self.server_threads: set[tuple[int, str]] = set()  # threads that ran the sidecar's code
    self._on = False
    self._src = str(SRC) + os.sep

  def _profile(self, frame: Any, event: str, arg: Any) -> None:
    if not self._on or event != "call":
      return
    name = frame.f_code.co_filename
    if name.startswith(self._src):
      rel = name[len(self._src):]
      self.files.add(rel)
      if rel.startswith(TRAINER):
        t = threading.current_thread()  # an ident is reused: the name tells two apart
        self.threads.setdefault((t.ident or 0, t.name), set()).add(rel)
      elif rel.startswith("server/"):
        t = threading.current_thread()
        self.server_threads.add((t.ident or 0, t.name))

  def install(self) -> None:
    """Profiles every thread started from now (Python 3.11 cannot reach those already
    running): call it before the sidecars and the controller start their threads."""
    threading.setprofile(self._profile)
    sys.setprofile(self._profile)

  def __enter__(self) -> Trace:
    self.files.clear()
    self.threads.clear()
    self._on = True
    return self

  def __exit__(self, *exc: Any) -> None:
    self._on = False


def report(path: str, trace: Trace) -> None:
  by = collections.Counter()
  for f in trace.files:
    side = ("sidecar" if f.startswith("server/") else
            "trainer" if f.startswith((*TRAINER, "arena/", "streams/")) else "shared")
    by[side] += 1
  own = sorted(f for f in trace.files if on_save_path(f))
  print(f"\n{path} save: {len(own)} files on the save's path, {len(trace.files)} files "
        f"of sidecar/_src ran (inclusive: sidecar {by['sidecar']}, trainer {by['trainer']}, "
        f"shared {by['shared']})")
  print(f"  on the save's path: {len(own)}")
  for f in own:
    print(f"    {f}")
  rest = sorted(trace.files - set(own))
  print(f"  the rest (a save's share of every RPC's and the feeds' code): {len(rest)}")
  for f in rest:
    print(f"    {f}")
  # A save's threads: those that ran the checkpoint core or a framework's adapter during
  # it (the in-process sidecars' threads and gRPC's own, which run the trainer's future
  # callbacks, "Thread-N (_run)", counted apart; a Worker's releaser runs arena/ only).
  ours = {k: v for k, v in trace.threads.items() if k not in trace.server_threads}
  grpc = {k: v for k, v in ours.items() if k[1].endswith("(_run)")}
  ours = {k: v for k, v in ours.items() if k not in grpc
          and any(f.startswith(SAVING) for f in v)}
  print(f"  trainer threads per save: {len(ours)} (each with the trainer files it ran; "
        f"{len(grpc)} of gRPC's ran trainer callbacks)")
  for (_, name), files in sorted(ours.items(), key=lambda kv: kv[0][1]):
    print(f"    {name}: {', '.join(sorted(files))}")


def _servers(tmp: str, n: int) -> list[Any]:
  from sidecar._src.core import options as options_lib
  from sidecar._src.server.server import Server
  from sidecar._src.user import registry as registry_lib
  hosts = os.path.join(tmp, "replica-hosts")
  servers = []
  for h in range(n):
    opts = options_lib.ServerOptions(
        port=0, health_port=0, socket_path=os.path.join(tmp, f"s{h}.sock"), host_id=h,
        shm_size=64 << 20, checkpoint_roots=(tmp,), replica_token="save-shape-token",
        listen="127.0.0.1", replica_hosts_file=hosts, device_ids=(h,))
    servers.append(Server(opts, registry=registry_lib.Registry()).start())
    with open(hosts, "w") as f:
      f.write("\n".join(s.address for s in servers))
  return servers


def _warm_then_trace(ckpt, state, trace: Trace) -> None:
  """Saves step 1 (imports and first-save work out of the way), then step 2 traced, to
  its end (durable, replicated, old steps dropped)."""
  ckpt.save(1, state).durable.result(60)
  ckpt.wait()
  with trace:
    handle = ckpt.save(2, state)
    handle.durable.result(60)
    handle.replicated.result(60)
    ckpt.wait()


def jax_save(tmp: str, addresses: list[str], trace: Trace) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import sidecar
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  rows = NamedSharding(mesh, P("data"))
  state = {"w": jax.device_put(jnp.ones((512, 256), jnp.float32), rows),
           "b": jax.device_put(jnp.zeros((256,), jnp.float32), NamedSharding(mesh, P())),
           "n": np.arange(8)}
  with sidecar.jax.Controller(addresses) as ctl, \
      ctl.checkpointer(os.path.join(tmp, "jax"), replicas=1) as ckpt:
    _warm_then_trace(ckpt, state, trace)


def dcp_save(tmp: str, addresses: list[str], trace: Trace) -> None:
  import torch

  import sidecar
  from sidecar._src.torch import controller as torch_controller
  state = {"w": torch.ones(512, 256), "b": torch.zeros(256)}
  with torch_controller.Controller(addresses[:1]) as ctl, \
      sidecar.torch.Checkpointer(os.path.join(tmp, "dcp"), replicas=0,
                                 controller=ctl) as ckpt:
    _warm_then_trace(ckpt, state, trace)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--paths", default="jax,dcp", help="which saves to trace: jax, dcp")
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  forms = count_forms()
  print(f"forms of a shard per save: {len(forms)}")
  for name, where in forms:
    print(f"    {name:36s} {where}")
  held = carriers()
  print(f"carriers of a shard's data beside its record (not forms): {len(held)}")
  for name, where, restates in held:
    print(f"    {name:36s} {where}{'  RESTATES THE SHARD: a form' if restates else ''}")
  plugs = plug_isinstance()
  print(f"isinstance checks on a plug: {len(plugs)}")
  for line in plugs:
    print(f"    {line}")
  trace = Trace()
  trace.install()
  with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
    servers = _servers(tmp, 2)
    try:
      addresses = [f"127.0.0.1:{s.port}" for s in servers]
      for path in args.paths.split(","):
        {"jax": jax_save, "dcp": dcp_save}[path](tmp, addresses, trace)
        report(path, trace)
    finally:
      for s in servers:
        s.stop(grace=0)


if __name__ == "__main__":
  main()
