"""A save the sidecar cannot write fails loudly (issue 62 item 2) and costs only itself
(issue 79 item 2): a full disk (a real small tmpfs), an I/O error (fault injection) and a
directory made read-only mid-run are said at once and raised by the trainer's ``wait()`` or
``close()`` (or, three in a row, its next ``save()``), once, naming the host, the step and
the cause; the steps committed before stay listed and whole."""

import contextlib
import errno
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.core import errors
from tests.conftest import eventually
from tests.support.paths import entries

pytestmark = pytest.mark.processes


@contextlib.contextmanager
def mounted(target, *args: str):
  """``mount ARGS TARGET`` for the block, then unmounted; the test is skipped where this
  machine refuses the mount (no root, no CAP_SYS_ADMIN in a container)."""
  try:
    p = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True,
                       timeout=30)
  except FileNotFoundError:
    pytest.skip("no mount command here")
  if p.returncode != 0:
    pytest.skip(f"mount {' '.join(args)} is refused here: {p.stderr.strip()}")
  try:
    yield
  finally:
    subprocess.run(["umount", str(target)], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def read_only_bind(directory):
  """``directory`` read-only for the block (a read-only bind mount over itself)."""
  with mounted(directory, "--bind", str(directory)):
    p = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True,
                       text=True, timeout=30)
    if p.returncode != 0:
      pytest.skip(f"a read-only bind mount is refused here: {p.stderr.strip()}")
    yield


@contextlib.contextmanager
def mode_555(directory):
  """``directory`` not writable for the block (its mode: for a user other than root)."""
  os.chmod(directory, 0o555)
  try:
    yield
  finally:
    os.chmod(directory, 0o755)


def notes(e: BaseException) -> str:
  return "\n".join(getattr(e, "__notes__", ()))


def test_a_full_disk_that_comes_back_costs_its_saves_and_one_that_stays_full_ends_the_run(
    tmp_path, caplog):
  """Issue 79 item 2: on a full disk, step N's write failed, the user freed space, and
  save(N + 1) still raised step N's failure and saved nothing. Saves of 1.2 MiB into a
  5 MiB tmpfs with 3 MiB of it taken: the second does not fit and is said at once; the
  space is freed, and the next save commits, saying so. Then the disk fills up for good:
  the save after three failures in a row raises the first one's ENOSPC, and close()
  raises a later failure no commit settled."""
  fs = tmp_path / "fs"
  fs.mkdir()
  with mounted(fs, "-t", "tmpfs", "-o", "size=5m", "tmpfs"):
    (fs / "ballast").write_bytes(b"\0" * (3 << 20))
    with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="32MiB",
                                      checkpoint_roots=[str(fs)]) as c, c.controller() as ctl:
      ckpt = ctl.checkpointer(fs / "ck", max_to_keep=None)
      save = lambda step: ckpt.save(step, {"w": np.full(300_000, step, np.float32)})  # noqa: E731
      save(1).durable.result(60)
      full = save(2)
      with pytest.raises(errors.CheckpointWriteError) as raised:
        full.durable.result(60)
      assert (raised.value.errno, raised.value.host_id) == (errno.ENOSPC, 0)
      said = lambda: "\n".join(r.getMessage() for r in caplog.records)  # noqa: E731
      assert eventually(lambda: "the save of step 2 into" in said()), said()
      assert "failed in the background: CheckpointWriteError: host 0 could not write step " \
             "2: No space left on device" in said() and "Training goes on" in said()
      (fs / "ballast").unlink()  # the user frees the space
      assert save(3).durable.result(60) == 3  # the run goes on: nothing raised
      ckpt.wait()
      assert ("step 3 is committed in " + str(fs / "ck") + " and the run goes on from it, "
              "after the failed save of step 2 (CheckpointWriteError ENOSPC). The latest "
              "committed step is 3") in said(), said()
      saved, step = [1, 3], 4
      with pytest.raises(errors.CheckpointWriteError) as raised:  # now it fills for good
        while step < 20:
          handle = save(step)
          if handle.durable.exception(60) is None:
            saved.append(step)
          step += 1
      e, first = raised.value, saved[-1] + 1
      assert e.errno == errno.ENOSPC and f"could not write step {first}:" in str(e)
      assert (f"3 saves in a row failed (max_failed_saves=3): the run ends here; save({step}) "
              f"saved nothing (step {step} not saved)") in notes(e), notes(e)
      assert step == first + 3 and ckpt.all_steps() == saved
      save(step)  # still no room
      with pytest.raises(errors.CheckpointWriteError, match=f"write step {step}") as again:
        ckpt.close()
      assert again.value.errno == errno.ENOSPC and "raised by close()" in notes(again.value)
      restored = ctl.checkpointer(fs / "ck").restore(target={"w": np.zeros(300_000, np.float32)})
      np.testing.assert_array_equal(restored["w"], np.full(300_000, saved[-1], np.float32))
    assert entries(fs / "ck") == [str(s) for s in sorted(saved, key=str)]


def test_an_io_error_on_one_host_is_raised_by_close_naming_that_host(tmp_path):
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(
      num_hosts=2, devices_per_host=1, shm_size="16MiB",
      host_env={1: {"SIDECAR_CKPT_FAULT": "eio@2"}}) as c, c.controller() as ctl:
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
    state = lambda v: {"w": jax.device_put(jnp.full((256, 128), v, jnp.float32), sharding)}
    ckpt = ctl.checkpointer(directory)
    ckpt.save(1, state(1.0)).durable.result(60)
    ckpt.save(2, state(2.0))
    with pytest.raises(errors.CheckpointWriteError,
                       match="host 1 could not write step 2: Input/output error") as raised:
      ckpt.close()
    assert (raised.value.errno, raised.value.host_id) == (errno.EIO, 1)
    assert "raised by close(). The latest committed step is 1" in notes(raised.value)
    assert ckpt.all_steps() == [1]
  assert entries(directory) == ["1"]


def test_a_directory_made_read_only_mid_run_fails_its_next_save(tmp_path):
  """As root, a read-only bind mount over the directory (root writes through any mode);
  else its mode: the save begun then fails, wait() raises it, and the save after the
  directory is writable again is durable."""
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1,
                                    shm_size="16MiB") as c, c.controller() as ctl:
    ckpt = ctl.checkpointer(directory)
    ckpt.save(1, {"w": np.ones(1000, np.float32)}).durable.result(60)
    read_only = read_only_bind(directory) if os.geteuid() == 0 else mode_555(directory)
    with read_only:
      ckpt.save(2, {"w": np.full(1000, 2, np.float32)})
      with pytest.raises((errors.CheckpointWriteError, errors.PermissionDeniedError)) as raised:
        ckpt.wait()
    if os.geteuid() == 0:
      assert raised.value.errno == errno.EROFS, repr(raised.value)
    assert "step 2" in str(raised.value) + notes(raised.value)
    assert "host 0" in str(raised.value) + notes(raised.value)
    assert ckpt.save(3, {"w": np.full(1000, 3, np.float32)}).durable.result(60) == 3
    ckpt.close()
    assert ckpt.all_steps() == [1, 3]
