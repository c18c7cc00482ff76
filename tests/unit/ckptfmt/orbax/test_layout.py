"""Tier 1: steps written host by host in Orbax's layout, checked against stock Orbax.

No sockets: each simulated host's part is written in this process from the shards
its devices own, as its sidecar would write them from the arena.
"""

import contextlib
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sidecar._src.ckptfmt import direct_io, records, spec as spec_lib
from sidecar._src.ckptfmt.orbax import (
  commit as orbax_commit,
  read as orbax_read,
  write as orbax_write,
)
from sidecar._src.core import errors
from sidecar._src.jax import checkpoint as jax_checkpoint
from tests.support.staged import staged

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def mesh():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.fail(f"needs 8 CPU devices, JAX started with {len(devices)}: set "
                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts "
                "(tests/conftest.py does)")
  return Mesh(np.array(devices[:8]).reshape(2, 4), ("x", "y"))


@pytest.fixture(scope="module")
def tree(mesh):
  def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  rng = np.random.default_rng(0)
  return {
      "w": put(rng.standard_normal((8, 16), dtype=np.float32), "x", "y"),
      "b": put(jnp.asarray(rng.standard_normal(16), dtype=jnp.bfloat16)),  # replicated
      "k": put(rng.integers(-2**31, 2**31 - 1, (4, 6), dtype=np.int32), None, "x"),
      "e": put(rng.standard_normal((8, 4), dtype=np.float32), "y"),  # half replicated
      "opt": [{"mu": put(rng.standard_normal(8, dtype=np.float32), ("x", "y"))}],
      "table": rng.integers(0, 100, (3, 5), dtype=np.int32),
      "step": 7,
      "lr": 0.25,
  }


@pytest.fixture(scope="module")
def stock_dir(tree, tmp_path_factory):
  """A step saved by stock Orbax (zstd, its default), for the read and layout checks."""
  directory = tmp_path_factory.mktemp("stock")
  with ocp.CheckpointManager(directory) as mgr:
    mgr.save(0, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
  return directory


@pytest.fixture(scope="module")
def stock_plain_dir(tree, tmp_path_factory):
  """A step saved by stock Orbax without OCDBT or compression: the layout written here."""
  directory = tmp_path_factory.mktemp("stock_plain")
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add("default", ocp.args.StandardSave,
               ocp.StandardCheckpointHandler(use_ocdbt=False))
  with ocp.CheckpointManager(directory, handler_registry=registry) as mgr:
    mgr.save(0, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
  return directory


def key_path(path):
  return tuple(k.key if isinstance(k, jax.tree_util.DictKey) else k.idx for k in path)


def flat(tree):
  return [(key_path(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def host_parts(tree, mesh, num_hosts):
  """The leaves' specs and each host's shards: the replica-0 shards on its devices, numpy
  and scalars on the last."""
  owner = {d: i * num_hosts // mesh.size for i, d in enumerate(mesh.devices.flat)}
  leaves = flat(tree)
  specs = [jax_checkpoint.leaf_spec(kp, v) for kp, v in leaves]
  paths = [spec.key_path for spec in specs]
  parts = []
  for host in range(num_hosts):
    part = []
    for leaf, (_, v) in enumerate(leaves):
      if isinstance(v, jax.Array):
        part += [staged(paths[leaf], leaf, s.index, s.data) for s in v.addressable_shards
                 if s.replica_id == 0 and owner[s.device] == host]
      elif host == num_hosts - 1:
        value = np.asarray(v)
        part.append(staged(paths[leaf], leaf, (slice(None),) * value.ndim, value))
    parts.append(part)
  return specs, parts


def assert_bit_exact(expected, got):
  expected, got = np.asarray(expected), np.asarray(got)
  assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
  assert got.tobytes() == expected.tobytes()


def layout(step_dir):
  """Relative file paths of a step."""
  return {str(p.relative_to(step_dir)) for p in pathlib.Path(step_dir).rglob("*") if p.is_file()}


@pytest.mark.parametrize(("num_hosts", "use_compression"), [(1, False), (2, False), (4, True)],
                         ids=["1host", "2hosts", "4hosts-zstd"])
def test_hosts_write_parts_and_stock_orbax_restores(tree, mesh, tmp_path, num_hosts,
                                                     use_compression):
  specs, parts = host_parts(tree, mesh, num_hosts)
  tmp = orbax_commit.create_tmp_step(tmp_path, 5)
  sums = []
  for host, part in enumerate(parts):
    sums += orbax_write.write_host_part(tmp, host, specs, part, use_compression=use_compression)
  final = orbax_commit.finalize(tmp, specs, num_hosts=num_hosts)

  assert final == tmp_path / "5" and not tmp.exists()
  assert orbax_read.list_steps(tmp_path) == [5]
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  with ocp.CheckpointManager(tmp_path) as mgr:
    assert mgr.all_steps() == [5]
    restored = mgr.restore(5, args=ocp.args.StandardRestore(abstract))
  for (kp, want), (_, got) in zip(flat(tree), flat(restored)):
    assert_bit_exact(want, got)
    if isinstance(want, jax.Array):
      assert got.sharding == want.sharding, kp
    else:
      assert type(got) is type(want), kp
  # Every unique shard was checksummed once, and the checksum matches what is on disk.
  unique = sum(len({str(s.index) for s in v.addressable_shards}) if isinstance(v, jax.Array)
               else 1 for _, v in flat(tree))
  assert len(sums) == unique
  for s in sums:
    assert s.crc32c == records.shard_crc32c(orbax_read.read_leaf(final, s.key_path, s.index)), s


def test_layout_matches_stock_orbax(tree, mesh, tmp_path, stock_plain_dir):
  specs, parts = host_parts(tree, mesh, 1)
  tmp = orbax_commit.create_tmp_step(tmp_path, 0)
  orbax_write.write_host_part(tmp, 0, specs, parts[0])
  ours, stock = orbax_commit.finalize(tmp, specs, num_hosts=1), stock_plain_dir / "0"

  # Stock Orbax splits the chunks of (partly) replicated arrays among the replicas.
  split = lambda name: name.split("/")[1] in ("b", "e", "k") if name.count("/") > 1 else False
  assert {n for n in layout(ours) if not split(n)} == {n for n in layout(stock) if not split(n)}
  assert layout(ours) >= {"_CHECKPOINT_METADATA", "commit_success.txt", "default/_METADATA",
                          "default/_sharding", "default/array_metadatas/process_0",
                          "default/w/.zarray", "default/w/0.0", "default/w/1.3", "default/b/0"}
  read = lambda d, name: json.loads((d / name).read_text())
  assert read(ours, "default/_sharding") == read(stock, "default/_sharding")
  ours_meta, stock_meta = read(ours, "default/_METADATA"), read(stock, "default/_METADATA")
  # Stock Orbax splits replicated arrays among replicas, so only write_shape may differ.
  for meta in (ours_meta, stock_meta):
    for entry in meta["tree_metadata"].values():
      entry["value_metadata"].pop("write_shape", None)
  assert ours_meta == stock_meta
  ours_step, stock_step = read(ours, "_CHECKPOINT_METADATA"), read(stock, "_CHECKPOINT_METADATA")
  assert ours_step.keys() == stock_step.keys()
  assert ours_step["item_handlers"] == stock_step["item_handlers"]
  assert 0 < ours_step["init_timestamp_nsecs"] <= ours_step["commit_timestamp_nsecs"]


def test_chunk_files_hold_the_bytes_orbax_writes(tree, mesh, tmp_path):
  """Shards go to their chunk files without TensorStore: the same bytes as through it."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add(None, ocp.args.PyTreeSave,
               ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False))
  with ocp.CheckpointManager(tmp_path / "stock", handler_registry=registry) as mgr:
    mgr.save(0, args=ocp.args.PyTreeSave(tree))
    mgr.wait_until_finished()
  specs, parts = host_parts(tree, mesh, 2)
  tmp = orbax_commit.create_tmp_step(tmp_path / "ours", 0)
  for host, part in enumerate(parts):
    orbax_write.write_host_part(tmp, host, specs, part)
  ours, stock = (orbax_commit.finalize(tmp, specs, num_hosts=2) / "default",
                 tmp_path / "stock/0/default")
  chunks = [p.relative_to(stock) for p in stock.glob("[wo]*/[0-9]*")]  # w, opt.0.mu: sharded
  assert len(chunks) == 8 + 8
  chunks += [pathlib.Path(leaf, ".zarray") for leaf in ("w", "opt.0.mu", "table")]
  for name in chunks:
    assert (ours / name).read_bytes() == (stock / name).read_bytes(), name


def thread_classes(name_prefix):
  """(scheduling policy, nice) of each of this process's threads whose name starts so."""
  out = []
  for task in pathlib.Path("/proc/self/task").iterdir():
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
      if (task / "comm").read_text().startswith(name_prefix):
        tid = int(task.name)
        out.append((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
  return out


def test_bytes_go_out_on_idle_class_threads(tree, mesh, tmp_path, monkeypatch):
  """Chunk writes and checksums yield the CPU to the training step (SCHED_IDLE); the
  caller, which runs TensorStore, and TensorStore's shared pool keep their class."""
  seen = []

  def spy(fn):
    def wrapped(*args, **kwargs):
      seen.append((fn.__name__, os.sched_getscheduler(0)))
      return fn(*args, **kwargs)
    return wrapped

  monkeypatch.setattr(direct_io, "write_file", spy(direct_io.write_file))
  # Patched where the write engine looks it up (ShardRecord.with_crc32c_of's module).
  monkeypatch.setattr(records, "shard_crc32c", spy(records.shard_crc32c))
  before = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)
  specs, parts = host_parts(tree, mesh, 1)
  tmp = orbax_commit.create_tmp_step(tmp_path, 0)
  sums = orbax_write.write_host_part(tmp, 0, specs, parts[0])  # the scalars go through TensorStore
  calls = [name for name, _ in seen]
  assert set(calls) == {"write_file", "shard_crc32c"}, seen
  assert calls.count("shard_crc32c") == len(sums) == len(parts[0])
  assert {policy for _, policy in seen} == {os.SCHED_IDLE}, seen
  assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == before
  assert set(thread_classes("ts_pool_")) == {before}
  restored = orbax_read.read_leaf(orbax_commit.finalize(tmp, specs, num_hosts=1), ("w",))
  assert_bit_exact(tree["w"], restored)


@pytest.mark.parametrize("writer", ["ours", "stock_raw", "stock_zstd", "stock_ocdbt"])
def test_read_item_shard_reads_whole_chunks_from_their_files(
    tree, mesh, tmp_path, monkeypatch, stock_plain_dir, stock_dir, writer):
  """Shards that are whole uncompressed chunks come straight from their files into the
  caller's array; the rest (scalars, OCDBT, zstd) through TensorStore; all the same."""
  if writer == "ours":
    specs, parts = host_parts(tree, mesh, 2)
    tmp = orbax_commit.create_tmp_step(tmp_path, 0)
    for host, part in enumerate(parts):
      orbax_write.write_host_part(tmp, host, specs, part)
    item = orbax_commit.finalize(tmp, specs, num_hosts=2) / spec_lib.ITEM
  elif writer == "stock_raw":
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(None, ocp.args.PyTreeSave,
                 ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False))
    with ocp.CheckpointManager(tmp_path, handler_registry=registry) as mgr:
      mgr.save(0, args=ocp.args.PyTreeSave(tree))
      mgr.wait_until_finished()
    item = tmp_path / "0" / spec_lib.ITEM
  else:
    item = (stock_plain_dir if writer == "stock_zstd" else stock_dir) / "0" / spec_lib.ITEM
  direct, allocated = [], []
  read_at = direct_io.read_at
  monkeypatch.setattr(direct_io, "read_at",
                      lambda fd, out, at: direct.append(fd) or read_at(fd, out, at))

  def allocate(shape, dtype):
    allocated.append(np.empty(shape, dtype))
    return allocated[-1]

  def one_chunk(kp, index):
    zarray = json.loads((item / ".".join(map(str, kp)) / ".zarray").read_text())
    return bool(index) and [b - a for a, b in index] == zarray["chunks"]

  shards, whole_chunks = 0, 0
  for kp, value in flat(tree):
    if isinstance(value, jax.Array):
      indices = {tuple(sl.indices(n)[:2] for sl, n in zip(s.index, value.shape))
                 for s in value.addressable_shards}
    else:
      indices = {tuple((0, n) for n in np.shape(value))}
    for index in sorted(indices):
      before = len(direct)
      got = orbax_read.read_item_shard(item, kp, index, allocate=allocate)
      expected = np.asarray(value)[tuple(slice(a, b) for a, b in index)]
      assert_bit_exact(expected, got)
      shards += 1
      whole_chunks += writer in ("ours", "stock_raw") and one_chunk(kp, index)
      if len(direct) > before:  # read from its file into the caller's array
        assert len(allocated) == len(direct) and got is allocated[-1], kp
  # Ours: a chunk per shard, but for the scalars ("step", "lr"). Stock Orbax splits
  # replicated shards into smaller chunks: those go through TensorStore.
  assert len(direct) == len(allocated) == whole_chunks
  assert whole_chunks == {"ours": shards - 2, "stock_raw": 17}.get(writer, 0)


def test_read_item_shard_names_a_chunk_file_of_the_wrong_size(tree, mesh, tmp_path):
  specs, parts = host_parts(tree, mesh, 1)
  tmp = orbax_commit.create_tmp_step(tmp_path, 0)
  orbax_write.write_host_part(tmp, 0, specs, parts[0])
  item = orbax_commit.finalize(tmp, specs, num_hosts=1) / spec_lib.ITEM
  chunk = item / "w" / "1.2"  # rows 4:8, columns 8:12 of w's 2 x 4 grid
  with open(chunk, "r+b") as f:
    f.truncate(chunk.stat().st_size - 1)
  with pytest.raises(errors.CorruptCheckpointError,
                     match=r"1\.2 holds 63 bytes where the chunk \[\[4, 8\], \[8, 12\]\] of 'w' "
                           r"takes 64: the file is corrupt"):
    orbax_read.read_item_shard(item, ("w",), ((4, 8), (8, 12)))
  assert_bit_exact(np.asarray(tree["w"])[:4, :4],
                   orbax_read.read_item_shard(item, ("w",), ((0, 4), (0, 4))))


def test_a_step_written_again_reads_its_new_values(tmp_path):
  """Reads share one TensorStore context per committed item; a step deleted and saved
  again under its number (OCDBT here) gets a fresh one, never the old values."""
  for value in (1.0, 2.0):
    with ocp.CheckpointManager(tmp_path) as mgr:
      mgr.save(0, args=ocp.args.StandardSave({"w": np.full((4, 4), value, np.float32)}))
      mgr.wait_until_finished()
    assert (orbax_read.read_leaf(tmp_path / "0", ("w",)) == value).all()
    assert orbax_read.item_leaves(tmp_path / "0" / spec_lib.ITEM)[0]["shape"] == [4, 4]
    shutil.rmtree(tmp_path / "0")


def test_read_leaf_reads_a_stock_orbax_step(tree, stock_dir):
  assert orbax_read.list_steps(stock_dir) == [0]
  step = stock_dir / "0"
  for kp, value in flat(tree):
    assert_bit_exact(np.asarray(value), orbax_read.read_leaf(step, kp))
  w = np.asarray(tree["w"])
  assert_bit_exact(w[4:8, 4:8], orbax_read.read_leaf(step, ("w",), (slice(4, 8), slice(4, 8))))
  assert_bit_exact(w[2:3, 0:16], orbax_read.read_leaf(step, ("w",), ((2, 3), (0, 16))))
  with pytest.raises(FileNotFoundError, match=r"leaf 'nope.0' is not in the checkpoint"):
    orbax_read.read_leaf(step, ("nope", 0))
  with pytest.raises(FileNotFoundError, match=r"_METADATA is missing"):
    orbax_read.read_leaf(stock_dir / "1", ("w",))


def test_uncommitted_step_is_not_listed(tree, mesh, tmp_path):
  specs, parts = host_parts(tree, mesh, 2)
  tmp = orbax_commit.create_tmp_step(tmp_path, 3)
  for host, part in enumerate(parts):
    orbax_write.write_host_part(tmp, host, specs, part)
  assert tmp.name == "3.orbax-checkpoint-tmp"
  assert orbax_read.list_steps(tmp_path) == []
  with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
      cleanup_tmp_directories=False)) as mgr:
    assert mgr.all_steps() == []  # Stock Orbax agrees.
  orbax_commit.finalize(tmp, specs, num_hosts=2)
  assert orbax_read.list_steps(tmp_path) == [3]


def test_finalize_refuses_a_missing_host_part(tree, mesh, tmp_path):
  specs, parts = host_parts(tree, mesh, 2)
  tmp = orbax_commit.create_tmp_step(tmp_path, 1)
  orbax_write.write_host_part(tmp, 0, specs, parts[0])
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"expected the parts of 2 hosts .* found \['process_0'\]"):
    orbax_commit.finalize(tmp, specs, num_hosts=2)
  assert orbax_read.list_steps(tmp_path) == [] and tmp.exists()


def test_finalize_refuses_missing_shards(tree, mesh, tmp_path):
  specs, parts = host_parts(tree, mesh, 2)
  # Host 1 reports in but drops its shards of "w".
  parts[1] = [s for s in parts[1] if s.record.key_path != ("w",)]
  tmp = orbax_commit.create_tmp_step(tmp_path, 1)
  for host, part in enumerate(parts):
    orbax_write.write_host_part(tmp, host, specs, part)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"incomplete: leaf 'w' has 4 of 8 chunks"):
    orbax_commit.finalize(tmp, specs, num_hosts=2)
  assert orbax_read.list_steps(tmp_path) == []


def test_leaf_spec_validates():
  with pytest.raises(errors.InvalidArgumentError, match=r"write_shape of 'a' must be a shard"):
    spec_lib.LeafSpec(key_path=("a",), shape=(4,), dtype=np.float32, write_shape=(5,))
  with pytest.raises(errors.InvalidArgumentError, match=r"key_path must be a non-empty tuple"):
    spec_lib.LeafSpec(key_path=(), shape=(4,), dtype=np.float32)
  with pytest.raises(errors.InvalidArgumentError, match=r"cannot checkpoint a str"):
    spec_lib.LeafSpec.from_value(("s",), "text")
  spec = spec_lib.LeafSpec.from_value(("opt", 0, "mu"), np.zeros(3, np.int8))
  assert (spec.param_name, spec.kind, spec.write_shape) == ("opt.0.mu", "np.ndarray", (3,))


def test_steps_are_created_and_committed_once(tmp_path):
  stale = orbax_commit.create_tmp_step(tmp_path, 2)
  (stale / "leftover").write_text("from a crashed attempt")
  tmp = orbax_commit.create_tmp_step(tmp_path, 2)
  assert not (tmp / "leftover").exists()
  with pytest.raises(errors.InvalidArgumentError, match=r"not an uncommitted step directory"):
    orbax_write.write_host_part(tmp_path / "2", 0, [], [])
  spec = spec_lib.LeafSpec(key_path=("x",), shape=(2,), dtype=np.int32, kind="np.ndarray")
  shard = staged(("x",), 0, ((0, 2),), np.arange(2, dtype=np.int32))
  orbax_write.write_host_part(tmp, 0, [spec], [shard])
  orbax_commit.finalize(tmp, [spec], num_hosts=1)
  assert_bit_exact(np.arange(2, dtype=np.int32), orbax_read.read_leaf(tmp_path / "2", ("x",)))
  with pytest.raises(FileExistsError, match=r"step 2 is already committed"):
    orbax_commit.create_tmp_step(tmp_path, 2)
  (tmp_path / "notes").mkdir()
  (tmp_path / "7.orbax-checkpoint-tmp").mkdir()
  assert orbax_read.list_steps(tmp_path) == [2]
