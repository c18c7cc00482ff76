"""Every registered format passes the same checks through the real sidecar, as Orbax tests
each of its handlers.

Parametrised over ``ckptfmt.registry.DEFAULT``: a format registered there runs here, and
fails until it has a driver (:data:`DRIVERS`: what a trainer's framework adapter makes
for one step's save in it: the path Begin takes, the leaves, the staged shards and the
format's typed parts; where they are staged and committed is the format's own, as a
trainer's ``Target`` asks it: ``Format.staged_dirs`` of Begin's answer, and
``Format.final_dir`` of the path Begin takes). The
checks go through an in-process sidecar over gRPC (the wire's format parts, the service,
``StepWriter``, ``Reader``, the RAM tier): save in two staged parts and commit, list,
the manifest (its format, step, data position, one checksum per shard), the format found
from the manifest on restore (no request names one), reads from RAM and from storage,
retention (delete), an aborted save leaving nothing, and a stored shard changed on disk
detected by its checksum.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt import records, registry as formats_lib
from sidecar._src.ckptfmt.dcp import DcpCommit, DcpPart, Item, distcp
from sidecar._src.ckptfmt.records import Staged
from sidecar._src.ckptfmt.save_values import Abort, Begin, Commit, Committed, Prepared, Stage
from sidecar._src.ckptfmt.spec import LeafKind, LeafSpec
from tests.support.staged import staged

pytestmark = pytest.mark.server

# One step's leaves and their shards: distinct values, so that each shard's bytes are found
# in exactly one stored file, whatever the format calls it.
_RNG = np.random.default_rng(43)
ARRAYS = {"w": _RNG.standard_normal((8, 4)).astype(np.float32),
          "b": _RNG.integers(1 << 20, 1 << 30, size=(6,), dtype=np.int32)}
SHARDS = (("w", ((0, 4), (0, 4))), ("w", ((4, 8), (0, 4))), ("b", ((0, 6),)))


def _data(name: str, index) -> np.ndarray:
  return np.ascontiguousarray(ARRAYS[name][tuple(slice(a, b) for a, b in index)])


@dataclasses.dataclass(frozen=True)
class Save:
  """One step's save in a format, as a trainer's framework adapter makes it."""

  begin: str  # the path Begin takes
  leaves: list[LeafSpec]  # what the first Stage and the Commit carry
  shards: list[Staged]  # in SHARDS' order
  first: Any  # the format's part of the first Stage
  rest: Any  # of the later ones
  commit: Any  # of the Commit


def orbax_save(directory: str, step: int) -> Save:
  """Orbax's layout: ``<directory>/<step>/default``, a shard numbered by its leaf."""
  names = list(ARRAYS)
  leaves = [LeafSpec(key_path=(n,), shape=ARRAYS[n].shape, dtype=ARRAYS[n].dtype,
                     write_shape=_data(*next(s for s in SHARDS if s[0] == n)).shape,
                     kind=LeafKind.NUMPY) for n in names]
  return Save(begin=directory, leaves=leaves,
              shards=[staged((n,), names.index(n), index, _data(n, index), host=0)
                      for n, index in SHARDS],
              first=None, rest=None, commit=None)


def dcp_save(directory: str, step: int) -> Save:
  """DCP's layout: the step is a DCP checkpoint at ``<directory>/<step>`` (as
  ``sidecar.torch.Checkpointer`` keeps them), each shard an item of rank 0's file."""
  items = tuple(Item(fqn=n, kind="tensor", nbytes=_data(n, index).nbytes,
                     dtype=ARRAYS[n].dtype.name, sizes=_data(n, index).shape,
                     offsets=tuple(a for a, _ in index)) for n, index in SHARDS)
  placements, size = distcp.layout(0, items)
  plan = {"storage": [{"fqn": i.fqn, "offset": list(i.offsets), "path": p.relative_path,
                       "at": p.offset, "length": p.length} for i, p in zip(items, placements)],
          "state": {n: {"kind": "tensor", "dtype": ARRAYS[n].dtype.name,
                        "chunks": [{"offsets": list(i.offsets), "sizes": list(i.sizes)}
                                   for i in items if i.fqn == n]} for n in ARRAYS}}
  path = f"{directory}/{step}"
  return Save(begin=path, leaves=[],
              shards=[Staged(i.record(k, 0, d, host=0), d)
                      for k, (i, d) in enumerate((i, _data(i.fqn, i.index)) for i in items)],
              first=DcpPart(0, len(items)), rest=DcpPart(0, len(items)),
              # DCP's pickled Metadata: the sidecar writes it as it is, never loads it.
              commit=DcpCommit(b"\x80\x04N.", {0: size}, json.dumps(plan)))


DRIVERS: dict[str, Callable[[str, int], Save]] = {"orbax": orbax_save, "dcp": dcp_save}


@pytest.fixture
def client(make_server):
  with sidecar.jax.Controller([f"127.0.0.1:{make_server().port}"], timeout=30) as ctl:
    yield ctl.checkpoint_client()


def _save(client, name: str, directory: str, step: int) -> str:
  """Saves ``step`` in format ``name``; returns its committed item directory."""
  s = DRIVERS[name](directory, step)
  tmp = client.send(0, Begin(s.begin, step, name)).result()
  fmt = formats_lib.DEFAULT.get(name)
  tmp_dir, final_dir = fmt.staged_dirs(tmp)[0], fmt.final_dir(s.begin, step)
  for shards, first, last in ((s.shards[:1], True, False), (s.shards[1:], False, True)):
    client.send(0, Stage(directory=directory, step=step, tmp_dir=tmp_dir, final_dir=final_dir,
                          leaves=s.leaves if first else [], shards=shards, last=last,
                          extra=s.first if first else s.rest)).result()
  sums = client.send(0, Prepared(final_dir, 30), timeout=30).result()
  client.send(0, Commit(tmp_dir=tmp_dir, step=step, num_hosts=1, leaves=s.leaves,
                          shards=sums, data_state_json=json.dumps({"step": step}),
                          whole_step=True, replicas=None, extra=s.commit),
                timeout=30).result()
  client.send(0, Committed(final_dir)).result()
  return final_dir


def _corrupt(final_dir: str, data: np.ndarray) -> pathlib.Path:
  """Flips a byte of ``data`` where a file under ``final_dir`` stores it; that file."""
  needle = data.tobytes()
  found = [(p, p.read_bytes().find(needle)) for p in pathlib.Path(final_dir).rglob("*")
           if p.is_file()]
  (path, at), = [(p, at) for p, at in found if at >= 0]
  with open(path, "r+b") as f:
    f.seek(at + len(needle) // 2)
    byte = f.read(1)
    f.seek(at + len(needle) // 2)
    f.write(bytes([byte[0] ^ 0xFF]))
  return path


@pytest.mark.parametrize("name", formats_lib.DEFAULT.names)
def test_a_registered_format_saves_lists_restores_keeps_and_detects_corruption(
    name, client, tmp_path):
  if name not in DRIVERS:
    pytest.fail(f"format {name!r} is registered (ckptfmt/registry.py) but has no conformance "
                f"driver: add one to DRIVERS in {__file__}")
  directory = str(tmp_path / "ck")
  assert client.open(0, directory, ram_steps=3, ram_budget=None, sweep=True).result() == []
  finals = {step: _save(client, name, directory, step) for step in (1, 2, 3)}
  assert client.open(0, directory, ram_steps=3, ram_budget=None, sweep=False).result() == [
      1, 2, 3]

  # The manifest: its format's one name, the step, the data position, every shard's crc32c.
  final = finals[3]
  manifest = client.info(0, final).result()
  assert (manifest.format, manifest.step, manifest.data_state) == (name, 3, {"step": 3})
  written = {(c.key_path, c.index): c for c in manifest.shards}  # what each read names
  assert {k: r.crc32c for k, r in written.items()} == {
      ((n,), index): records.shard_crc32c(_data(n, index)) for n, index in SHARDS}
  # A restore names no format: the sidecar finds it from the manifest.
  assert formats_lib.DEFAULT.of_committed(final).name == name
  for n, index in SHARDS:
    for tier in ("ram", "disk"):
      got = client.read(0, final, written[((n,), index)], tier=tier).result()
      np.testing.assert_array_equal(np.asarray(got).reshape(_data(n, index).shape),
                                    _data(n, index), err_msg=f"{n}{index} from {tier}")

  # Retention: a committed step goes whole, and is no longer listed.
  client.delete(0, directory, 1).result()
  assert not (tmp_path / "ck" / "1").exists()
  assert client.open(0, directory, ram_steps=3, ram_budget=None, sweep=False).result() == [2, 3]

  # An aborted save leaves nothing behind, and is never listed.
  s = DRIVERS[name](directory, 4)
  tmp = client.send(0, Begin(s.begin, 4, name)).result()
  fmt = formats_lib.DEFAULT.get(name)
  tmp_dir, final_dir = fmt.staged_dirs(tmp)[0], fmt.final_dir(s.begin, 4)
  client.send(0, Stage(directory=directory, step=4, tmp_dir=tmp_dir, final_dir=final_dir,
                        leaves=s.leaves, shards=s.shards[:1], last=False, extra=s.first)).result()
  client.send(0, Abort(tmp, final_dir), timeout=30).result()
  assert not pathlib.Path(tmp).exists() and not pathlib.Path(final_dir).exists()
  assert client.open(0, directory, ram_steps=3, ram_budget=None, sweep=False).result() == [2, 3]

  # A stored shard changed after the save fails its checksum; the RAM copy still reads.
  n, index = SHARDS[1]
  _corrupt(final, _data(n, index))
  with pytest.raises(sidecar.CorruptCheckpointError, match="does not match its crc32c"):
    client.read(0, final, written[((n,), index)], tier="disk").result()
  np.testing.assert_array_equal(
      np.asarray(client.read(0, final, written[((n,), index)], tier="ram").result()
                 ).reshape(_data(n, index).shape), _data(n, index))


@pytest.mark.parametrize("name", formats_lib.DEFAULT.names)
def test_a_begin_names_its_format_by_its_one_name(name, client, tmp_path):
  """Only the registered names: no empty name for Orbax's, no old spelling."""
  directory = str(tmp_path / "ck")
  client.open(0, directory, ram_steps=1, ram_budget=None, sweep=True).result()
  for other in ("", "colocated-sidecar", name.upper()):
    with pytest.raises(sidecar.InvalidArgumentError,
                       match=rf"format must be one of the registered formats "
                       rf"{formats_lib.DEFAULT.names!r}, got {other!r}".replace("[", r"\[")
                       .replace("]", r"\]")):
      client.send(0, Begin(DRIVERS[name](directory, 1).begin, 1, other)).result()
