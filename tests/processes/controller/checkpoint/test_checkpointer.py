"""Tier 3: ctl.checkpointer on LocalClusters, checked against stock Orbax."""

import gc
import json
import os
import re
import stat
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually
from tests.support.paths import entries
from tests.support.states import abstract, assert_same

pytestmark = pytest.mark.processes

FNS = ["tests.support.sidecar_fns"]


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="64MiB",
                                    imports=FNS) as c:
    yield c


def mesh(n=4, axes=("data",)):
  return Mesh(np.array(jax.devices()[:n]).reshape(-1 if len(axes) == 1 else (2, n // 2)), axes)


def make_state():
  m = mesh()
  sharded = NamedSharding(m, P("data"))
  replicated = NamedSharding(m, P())
  return {
      "params": {"w": jax.device_put(jnp.arange(2048 * 64, dtype=jnp.float32).reshape(2048, 64),
                                     sharded),
                 "b": jax.device_put(jnp.ones(8, jnp.bfloat16), replicated)},
      "step_count": jax.device_put(jnp.int32(7), replicated),
      "table": np.arange(10, dtype=np.int64),
  }


def test_save_is_staged_then_durable_and_stock_orbax_restores_it(cluster, tmp_path):
  state = make_state()
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    handle = ckpt.save(10, state, data_state={"epoch": 1, "position": 64})
    assert handle.staged.result(30) == 10 and handle.durable.result(60) == 10
    assert ckpt.all_steps() == [10] and ckpt.latest_step() == 10
    assert ckpt.data_state(10) == {"epoch": 1, "position": 64}
  assert "step 10: wrote" in cluster.log(0) + cluster.log(1)  # the sidecars log their writes
  mngr = ocp.CheckpointManager(tmp_path / "ck")
  assert mngr.all_steps() == [10]
  restored = mngr.restore(10, args=ocp.args.StandardRestore(abstract(state)))
  assert_same(restored, state)


def test_restore_from_ram_and_from_disk_onto_another_sharding(cluster, tmp_path):
  state = make_state()
  with cluster.controller() as ctl:
    with ctl.checkpointer(tmp_path / "ck", ram_steps=1) as ckpt:
      ckpt.save(1, state).durable.result(60)
      from_ram = ckpt.restore(target=abstract(state))
      assert_same(from_ram, state)
      w = from_ram["params"]["w"]
      shard = w.addressable_shards[0]
      buf = ctl.worker(0).arena.buffer
      assert buf.ctypes.data <= shard.data.unsafe_buffer_pointer() < buf.ctypes.data + buf.nbytes
    other = NamedSharding(mesh(4, ("a", "b")), P("b", "a"))  # reshard onto a 2x2 mesh
    target = abstract(state)
    target["params"]["w"] = jax.ShapeDtypeStruct((2048, 64), jnp.float32, sharding=other)
    with ctl.checkpointer(tmp_path / "ck") as fresh:  # a new checkpointer: disk or RAM
      resharded = fresh.restore(1, target=target)
    assert resharded["params"]["w"].sharding == other
    assert_same(resharded, state)


def test_our_restore_reads_a_step_stock_orbax_wrote(cluster, tmp_path):
  state = make_state()
  mngr = ocp.CheckpointManager(tmp_path / "ck")
  mngr.save(3, args=ocp.args.StandardSave(state))
  mngr.wait_until_finished()
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    assert ckpt.all_steps() == [3]
    assert_same(ckpt.restore(3, target=abstract(state)), state)
    other = NamedSharding(mesh(4, ("a", "b")), P("b", "a"))  # and onto another sharding
    target = abstract(state)
    target["params"]["w"] = jax.ShapeDtypeStruct((2048, 64), jnp.float32, sharding=other)
    assert_same(ckpt.restore(3, target=target), state)
    assert ckpt.data_state(3) is None


def test_snapshot_isolation_under_donation(cluster, tmp_path):
  state = make_state()
  expected = jax.tree.map(np.asarray, state)

  @jax.jit
  def bump(s):
    return jax.tree.map(lambda x: x + 1, s)

  bump_donate = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    arrays = {"params": state["params"], "step_count": state["step_count"]}
    handle = ckpt.save(5, arrays)
    handle.staged.result(30)
    arrays = bump_donate(arrays)  # donates (deletes) the saved buffers
    del bump
    handle.durable.result(60)
    restored = ckpt.restore(5, target=abstract({"params": state["params"],
                                                "step_count": state["step_count"]}))
  assert_same(restored, {"params": expected["params"], "step_count": expected["step_count"]})


def test_bad_input(cluster, tmp_path):
  state = make_state()
  with cluster.controller() as ctl:
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() != 0:  # root writes anywhere; the check is for real users
      with pytest.raises(sidecar.InvalidArgumentError, match="is not writable"):
        ctl.checkpointer(ro)
    (tmp_path / "a-file").write_text("")  # not a directory, for root too
    # Under a file, or a file: no write access would help, so say what the path is.
    for path in (tmp_path / "a-file" / "ck", tmp_path / "a-file"):
      file = re.escape(str(tmp_path / "a-file"))
      with pytest.raises(sidecar.InvalidArgumentError,
                         match=f"{file} is a regular file, not a directory: a checkpoint "
                               "directory must be a directory; pick another path"):
        ctl.checkpointer(path)
    with pytest.raises(PermissionError, match="is not under a checkpoint root"):
      ctl.checkpointer("/proc/no-such-dir/ck")
    with ctl.checkpointer(tmp_path / "ck", max_to_keep=2) as ckpt:
      for step in (1, 2, 3):
        ckpt.save(step, state).durable.result(60)
      ckpt.wait()  # durable, then the steps max_to_keep drops are deleted
      assert ckpt.all_steps() == [2, 3]
      assert entries(tmp_path / "ck") == ["2", "3"]
      with pytest.raises(sidecar.InvalidArgumentError,  # as sidecar.torch's (issue 55)
                         match=r"step 3 is already saved in .*; a save never replaces a "
                         r"committed step: to resume, restore the latest \(latest_step\(\) is 3\)"):
        ckpt.save(3, state)
      with pytest.raises(sidecar.InvalidArgumentError, match=r"step 9 does not exist.*\[2, 3\]"):
        ckpt.restore(9, target=abstract(state))
      wrong = abstract(state)
      wrong["params"]["w"] = jax.ShapeDtypeStruct((2048, 4), jnp.float32,
                                                  sharding=state["params"]["w"].sharding)
      with pytest.raises(sidecar.InvalidArgumentError,
                         match=r"target leaf .params.w. is float32\[2048, 4\] but step 3 saved"):
        ckpt.restore(target=wrong)
      with pytest.raises(sidecar.InvalidArgumentError,
                         match=r"save a tree of arrays such as \{'w': w\}, not a bare ArrayImpl"):
        ckpt.save(4, state["params"]["w"])
      huge = {"x": np.zeros((200 << 20) // 4, np.float32)}
      with pytest.raises(sidecar.ResourceExhaustedError, match=r"does not fit.*--shm-size"):
        ckpt.save(4, huge)
      assert ckpt.all_steps() == [2, 3]


@pytest.mark.parametrize("tear", ["flip", "truncate"])
def test_torn_write_is_detected_and_ram_tier_serves(cluster, tmp_path, tear):
  state = {"w": jax.device_put(jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256),
                               NamedSharding(mesh(), P("data")))}
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    ckpt.save(1, state).durable.result(60)
    data_files = sorted((tmp_path / "ck" / "1" / "default" / "w").glob("[0-9]*"))
    assert len(data_files) == 4  # a chunk file per shard
    for path in data_files:
      with open(path, "r+b") as f:
        if tear == "truncate":  # a write cut short
          f.truncate(os.path.getsize(path) - 4096)
          continue
        f.seek(os.path.getsize(path) // 2)  # flip a byte in the middle of every chunk
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert_same(ckpt.restore(1, target=abstract(state)), state)  # from the RAM tier
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="16MiB",
                                    imports=FNS) as fresh, fresh.controller() as ctl2:
    with ctl2.checkpointer(tmp_path / "ck") as ckpt2:  # no RAM tier: storage only
      expected = {"flip": r"array 'w' shard \[\[\d+, \d+\], \[0, 256\]\] does not match its crc32c",
                  "truncate": r"default/w/\d\.0 holds 61440 bytes where a chunk of 'w' "
                              r"takes 65536: the file is corrupt"}[tear]
      with pytest.raises(sidecar.CorruptCheckpointError, match=expected):
        ckpt2.restore(1, target=abstract(state))
      # the blocks read before the error go back (freed by the Worker's releaser thread)
      assert eventually(lambda: ctl2.status()[0].arena_used == 0, timeout=30)


def test_manifest_checksums_match_the_files(cluster, tmp_path):
  """Each shard's crc32c in the manifest is that of its chunk as stored."""
  from sidecar._src.ckptfmt import records
  from sidecar._src.ckptfmt.orbax import read as orbax_read
  state = make_state()
  state["transposed"] = np.arange(64 * 48, dtype=np.float32).reshape(64, 48).T  # not C order
  state["scalar"] = 3.5
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    ckpt.save(1, state).durable.result(60)
  manifest = json.loads((tmp_path / "ck" / "1" / "default" / "sidecar_manifest.json").read_text())
  assert len(manifest["shards"]) == 4 + 5  # w: 4 shards; the other leaves one each
  for s in manifest["shards"]:
    data = orbax_read.read_leaf(tmp_path / "ck" / "1", tuple(s["key_path"]),
                        tuple(tuple(i) for i in s["index"]))
    assert s["nbytes"] == data.nbytes and s["crc32c"] == records.shard_crc32c(data), s
  assert any(s["crc32c"] != 0 for s in manifest["shards"])


def test_status_lists_the_steps_each_tier_holds(cluster, tmp_path, capsys):
  from sidecar._src.tools import cli
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck", ram_steps=2) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, make_state()).durable.result(60)
    assert cli.main(["status", *cluster.addresses]) == 0
  out = capsys.readouterr().out
  assert f"host 0  {tmp_path / 'ck'}  RAM tier: [2, 3]" in out


def test_orbax_checkpoint_manager_with_the_sidecar_handler(cluster, tmp_path):
  import sidecar.orbax
  state = make_state()
  directory = tmp_path / "ck"
  with cluster.controller() as ctl:
    handler = sidecar.orbax.SidecarCheckpointHandler(ctl)
    mngr = ocp.CheckpointManager(directory, item_names=("state", "data"),
                                 item_handlers={"state": handler},
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2))
    for step in (1, 2, 3):
      mngr.save(step, args=ocp.args.Composite(
          state=sidecar.orbax.SidecarSave(state),
          data=sidecar.orbax.FeedStateSave({"position": step})))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3]
    restored = mngr.restore(3, args=ocp.args.Composite(
        state=sidecar.orbax.SidecarRestore(abstract(state)), data=sidecar.orbax.FeedStateRestore()))
    assert_same(restored["state"], state)
    assert restored["data"] == {"position": 3}
    w = restored["state"]["params"]["w"].addressable_shards[0].data
    buf = ctl.worker(0).arena.buffer  # from the RAM tier: the arena itself
    assert buf.ctypes.data <= w.unsafe_buffer_pointer() < buf.ctypes.data + buf.nbytes
    meta = mngr.item_metadata(3)["state"]
    assert meta == {"params": {"w": jax.ShapeDtypeStruct((2048, 64), jnp.float32),
                               "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16)},
                    "step_count": jax.ShapeDtypeStruct((), jnp.int32),
                    "table": jax.ShapeDtypeStruct((10,), np.int64)}
    mngr.close()
  # Stock Orbax reads the item the sidecars wrote, without the handler.
  plain = ocp.CheckpointManager(directory, item_names=("state",))
  again = plain.restore(3, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract(state))))
  assert_same(again["state"], state)


def test_wait_reports_progress_while_a_save_is_written(tmp_path):
  # Host 1 holds its write of step 1 until `go` exists (a fixed pause raced the first
  # report on a loaded machine); the report that shows host 1 alone writing lets it go.
  go = tmp_path / "go"
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="16MiB",
                                    host_env={1: {"SIDECAR_CKPT_FAULT": f"slow@1:{go}"}}) as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
      lines = []

      def report(line):
        lines.append(line)
        if "of 256.0 KiB" in line:  # host 0 is done: only host 1's half of w is left
          go.touch()
      ckpt.save(1, make_state())
      ckpt.wait(progress=report)
      assert ckpt.all_steps() == [1]
  assert lines and all(l.startswith("saving step 1: ") and " durable (" in l for l in lines)
  assert any("0 B of 256.0 KiB" in line for line in lines), lines  # host 1 held, reported


@pytest.mark.parametrize("if_busy", ["wait", "skip"])
def test_at_most_one_save_in_flight(tmp_path, if_busy, caplog):
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="16MiB",
                                    host_env={1: {"SIDECAR_CKPT_FAULT": "slow@1"}}) as c:
    with c.controller() as ctl, ctl.checkpointer(tmp_path / "ck", if_busy=if_busy) as ckpt:
      first = ckpt.save(1, make_state())
      second = ckpt.save(2, make_state())  # step 1 is still being written (2 s)
      if if_busy == "wait":
        assert first.durable.done()  # save(2) waited for it, and said so
        assert any("save(2)" in r.getMessage() and "waited" in r.getMessage()
                   and "for step 1 to be durable" in r.getMessage()
                   and r.levelname == "WARNING" for r in caplog.records), caplog.text
        assert second.durable.result(60) == 2 and ckpt.all_steps() == [1, 2]
      else:
        assert second.staged.result() is None and second.durable.result() is None
        assert first.durable.result(60) == 1 and ckpt.all_steps() == [1]
    with c.controller() as ctl2, pytest.raises(sidecar.InvalidArgumentError,
                                               match="if_busy must be 'wait' or 'skip'"):
      ctl2.checkpointer(tmp_path / "ck", if_busy="queue")


def settled(read, *, quiet: float = 0.3, timeout: float = 10.0):
  """``read()`` once it has stopped changing for ``quiet`` seconds: frees of blocks let go
  just before travel to the sidecars asynchronously."""
  value, since, deadline = read(), time.monotonic(), time.monotonic() + timeout
  while time.monotonic() - since < quiet and time.monotonic() < deadline:
    time.sleep(0.05)
    now = read()
    if now != value:
      value, since = now, time.monotonic()
  return value


def test_a_save_staged_in_parts_and_one_failing_mid_copy(cluster, tmp_path, monkeypatch):
  """Parts go to the sidecars while the trainer copies; a copy that fails aborts them."""
  from sidecar._src.controller.checkpoint import staging
  monkeypatch.setattr(staging, "STAGE_LOT_BYTES", 1)  # every shard its own part
  state = make_state()
  arena_used = lambda ctl: sorted(s.arena_used for s in ctl.status())
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    ckpt.save(1, state).durable.result(60)
    assert_same(ckpt.restore(1, target=abstract(state)), state)
    gc.collect()
    before = settled(lambda: arena_used(ctl))  # step 1 in the RAM tier, frees all arrived

    copy, calls = staging.shm.copy, []
    def failing_copy(dst, src, **kw):
      calls.append(src.nbytes)
      if len(calls) == 4:
        raise OSError("copy failed")
      copy(dst, src, **kw)
    monkeypatch.setattr(staging.shm, "copy", failing_copy)
    with pytest.raises(OSError, match="copy failed"):
      ckpt.save(2, state)
    monkeypatch.setattr(staging.shm, "copy", copy)
    # The parts already staged were dropped with the step, before save() raised: its
    # files (the uncommitted step directory too), RAM tier, blocks.
    assert entries(tmp_path / "ck") == ["1"]
    assert eventually(lambda: arena_used(ctl) == before)
    assert ckpt.all_steps() == [1]
    ckpt.save(2, state).durable.result(60)
    assert ckpt.all_steps() == [1, 2]
    assert_same(ckpt.restore(2, target=abstract(state)), state)


@pytest.mark.parametrize("ram_steps", [1, 0], ids=["from-ram", "from-disk"])
def test_a_restored_tree_gives_its_blocks_back_at_its_last_reference(cluster, tmp_path,
                                                                     ram_steps):
  """Without the garbage collector, restores one after the other hold one restore's blocks:
  no reference cycle holds a restored array's block (repeated restores filled the arena,
  then failed as lost data), and those JAX still holds for dropped arrays come back
  before the next restore reads."""
  state = make_state()
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck",
                                                     ram_steps=ram_steps) as ckpt:
    ckpt.save(1, state).durable.result(60)
    workers = [ctl.worker(h.host_id) for h in ctl.hosts]
    live = lambda: [w.live_blocks for w in workers]
    gc.collect()
    before = settled(live)
    gc.disable()
    try:
      held = []
      for _ in range(4):
        restored = ckpt.restore(1, target=abstract(state))
        assert_same(restored, state)
        held.append(settled(live))
        del restored
      assert sum(held[0]) > sum(before) and held == [held[0]] * 4, (before, held)
    finally:
      gc.enable()
