"""A save that fails in an in-process sidecar (a full disk): everything comes back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually
from tests.support.states import abstract

pytestmark = pytest.mark.server


def test_a_save_that_fails_on_a_full_disk_releases_everything_and_the_next_save_works(
    make_server, tmp_path, monkeypatch):
  """ENOSPC once step 2's first shard is on disk ("enospc@2"): step 2 fails, the trainer's
  arena copy and the sidecar's staged blocks come back, and step 3 saves and restores."""
  from sidecar._src.server.checkpoint.faults import FAULT_ENV
  monkeypatch.setenv(FAULT_ENV, "enospc@2")  # read by the in-process sidecar as it writes
  server = make_server(shm_size=16 << 20, device_ids=(0,))
  one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())

  def state(value):
    return {"w": jax.device_put(jnp.full((256, 128), value, jnp.float32), one),
            "n": np.arange(4) + int(value)}
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl, \
      ctl.checkpointer(tmp_path / "ck", replicas=0) as ckpt:
    ckpt.save(1, state(1.0)).durable.result(60)
    held = server.leases.allocator.used_bytes  # step 1 in the RAM tier
    ckpt.save(2, state(2.0))
    with pytest.raises(sidecar.SidecarError, match="No space left on device"):
      ckpt.wait()
    assert eventually(lambda: ctl.worker(0).live_blocks == 0)
    assert eventually(lambda: server.leases.allocator.used_bytes <= held)
    assert ckpt.all_steps() == [1]
    ckpt.save(3, state(3.0)).durable.result(60)  # the disk has room again: no fault at 3
    assert ckpt.all_steps() == [1, 3]
    restored = ckpt.restore(3, target=abstract(state(3.0)))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 128), 3.0))
    np.testing.assert_array_equal(restored["n"], np.arange(4) + 3)
  assert not any((tmp_path / "ck").glob("2*"))


def test_a_chunk_write_that_fails_with_an_os_error_is_a_checkpoint_write_error(
    make_server, tmp_path, monkeypatch):
  """A chunk write that fails as on a full disk (ENOSPC) comes back as
  CheckpointWriteError with its errno, the file and the host, not InvalidArgumentError.
  (The chunk file cannot be a symlink to /dev/full: chunk files open with O_NOFOLLOW.)"""
  import errno
  import os

  from sidecar._src.ckptfmt import direct_io
  pwrite = os.pwrite

  def onto_a_full_disk(fd, piece, at):  # the chunk files of the step fail with ENOSPC
    if "1.orbax-checkpoint-tmp" in os.readlink(f"/proc/self/fd/{fd}"):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return pwrite(fd, piece, at)
  server = make_server(shm_size=16 << 20, device_ids=(0,))
  one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())
  state = {"w": jax.device_put(jnp.ones((256, 128), jnp.float32), one)}
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl, \
      ctl.checkpointer(tmp_path / "ck", replicas=0) as ckpt:
    monkeypatch.setattr(direct_io.os, "pwrite", onto_a_full_disk)  # the in-process sidecar's
    ckpt.save(1, state)
    with pytest.raises(sidecar.CheckpointWriteError) as raised:
      ckpt.wait()
    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    e = raised.value
    assert (e.errno, e.host_id) == (errno.ENOSPC, 0) and isinstance(e, OSError)
    assert e.path.startswith(str(tmp_path / "ck" / "1.orbax-checkpoint-tmp")), e.path
    assert f"host 0 could not write step 1: No space left on device (ENOSPC) writing {e.path}" \
        in str(e)
    assert ckpt.all_steps() == []
    ckpt.save(2, state).durable.result(60)  # the disk has room again
    assert ckpt.all_steps() == [2]


def test_a_trainer_that_stages_inline_is_told_why_its_write_failed_mid_save(
    make_server, tmp_path, monkeypatch):
  """Review of issue 69: a trainer with no worker session (``attach=False``: its shards
  travel inline in its Stages) has no liveness the sidecar knows. A write that failed
  before its step was whole dropped the step at once, and the trainer's next part began a
  new, partial one: the save raised "shard of leaf 1: the step has 0 leaves"
  (InvalidArgumentError), never why. Now the failed step is kept, its bytes let go, and
  the next part is refused with the write's own error; the trainer's abort removes it.

  The write fails on a real file: one put where the step's item directory goes while its
  writer is held ("slow@2:PATH"), between the trainer's first part and its second."""
  import errno
  import time

  from sidecar._src.ckptfmt.save_values import Stage
  from sidecar._src.controller.checkpoint import client as client_lib, staging
  from sidecar._src.server.checkpoint.faults import FAULT_ENV
  go = tmp_path / "go"
  monkeypatch.setenv(FAULT_ENV, f"slow@2:{go}")  # step 2's writer waits for go
  monkeypatch.setattr(staging, "STAGE_LOT_BYTES", 1)  # every shard its own part
  server = make_server(shm_size=16 << 20, device_ids=(0,))
  tier = server.checkpoints.tier
  tmp = tmp_path / "ck" / "2.orbax-checkpoint-tmp"
  send = client_lib.CheckpointClient.send
  held = []

  def second_part_once_the_write_failed(self, host, part, **kw):
    if (isinstance(part, Stage) and part.step == 2 and part.begin is None
        and not held):  # the first part began it
      held.append(part)
      (tmp / "default").write_bytes(b"in the item directory's way")
      go.touch()
      deadline = time.monotonic() + 60
      while tier.writing() and time.monotonic() < deadline:  # its write fails meanwhile
        time.sleep(0.01)
    return send(self, host, part, **kw)
  monkeypatch.setattr(client_lib.CheckpointClient, "send", second_part_once_the_write_failed)
  state = lambda value: {k: np.full(1 << 14, value + i, np.float32) for i, k in enumerate("abc")}
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=False) as ctl, \
      ctl.checkpointer(tmp_path / "ck", replicas=0) as ckpt:
    assert ctl.worker(0) is None  # no worker session: the Stages carry the shards inline
    ckpt.save(1, state(1.0)).durable.result(60)
    ckpt.save(2, state(2.0))
    with pytest.raises(sidecar.CheckpointWriteError) as raised:
      ckpt.wait()
    e = raised.value
    assert held and (e.errno, e.host_id, e.path) == (errno.ENOTDIR, 0, str(tmp / "default"))
    assert str(e).startswith(f"host 0 could not write step 2: Not a directory (ENOTDIR) "
                             f"writing {tmp / 'default'}; "), e
    assert tier.find(str(tmp_path / "ck" / "2" / "default")) is None  # the abort removed it
    assert ckpt.all_steps() == [1] and not tmp.exists()
    ckpt.save(3, state(3.0)).durable.result(60)  # the next save works
    restored = ckpt.restore(3, target=abstract(state(3.0)))
    np.testing.assert_array_equal(restored["c"], np.full(1 << 14, 5.0, np.float32))


def test_a_step_committed_all_the_same_after_its_save_failed_is_listed_and_kept(
    make_server, tmp_path, monkeypatch, caplog):
  """Step 2's commit by the sidecar is held at its rename while the trainer's wait for it
  gives up (its deadline made short): the trainer aborts the step, which its sidecar
  commits all the same. The save's error stands (saying so), and the checkpointer lists
  step 2 at once as a commit does, max_to_keep dropping step 1 (it listed [1] until the
  directory's next open)."""
  import logging

  from sidecar._src.controller.checkpoint import save_protocol
  from sidecar._src.server.checkpoint.faults import FAULT_ENV
  release = tmp_path / "release"
  monkeypatch.setenv(FAULT_ENV, f"slowrename@2:{release}")
  caplog.set_level(logging.INFO, logger="sidecar")
  server = make_server(shm_size=16 << 20, device_ids=(0,))
  one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())
  state = {"w": jax.device_put(jnp.ones((256, 128), jnp.float32), one)}
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl, \
      ctl.checkpointer(tmp_path / "ck", replicas=0, max_to_keep=1) as ckpt:
    ckpt.save(1, state).durable.result(60)
    monkeypatch.setattr(save_protocol, "LONG_S", 2.0)  # the trainer's wait for the commit
    ckpt.save(2, state)
    assert eventually(lambda: "waits for its commit under way" in caplog.text, 60)
    release.touch()
    with pytest.raises(sidecar.SidecarError) as raised:
      ckpt.wait()
    assert any("step 2 was committed all the same" in n for n in raised.value.__notes__)
    assert ckpt.all_steps() == [2] and ckpt.latest_step() == 2
    assert eventually(lambda: not (tmp_path / "ck" / "1").exists())
    restored = ckpt.restore(2, target=abstract(state))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((256, 128)))
