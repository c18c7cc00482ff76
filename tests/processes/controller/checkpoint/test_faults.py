"""SIGKILL at each point of a save's sequence: the step before restores bit-exact, no leaks."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import arena_mappers, eventually, shm_entries
from tests.support import paths
from tests.support.paths import entries
from tests.support.states import abstract

pytestmark = pytest.mark.processes

ROOT = str(paths.ROOT)


def state(value: float):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
  return {"w": jax.device_put(jnp.full((256, 128), value, jnp.float32), sharding),
          "n": np.arange(4) + int(value)}


def check_only_step_1(directory):
  """A fresh deployment sees step 1 alone, restores it bit-exact, and swept step 2's tmp."""
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB") as c:
    with c.controller() as ctl, ctl.checkpointer(directory) as ckpt:
      assert ckpt.all_steps() == [1]
      restored = ckpt.restore(target=abstract(state(1.0)))
      np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 128), 1.0))
      np.testing.assert_array_equal(restored["n"], np.arange(4) + 1)
  assert entries(directory) == ["1"]


@pytest.mark.parametrize("point,host", [
    ("stage", 1), ("write", 1), ("prepared", 1), ("commit", 0)],
    ids=["during-staging", "during-writing", "after-prepared", "during-commit"])
def test_sidecar_killed_during_a_save(tmp_path, point, host):
  before, mappers = shm_entries(), set(arena_mappers())
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(
      num_hosts=2, devices_per_host=1, shm_size="16MiB",
      host_env={host: {"SIDECAR_CKPT_FAULT": f"{point}@2"}}) as c:
    with c.controller() as ctl, ctl.checkpointer(directory) as ckpt:
      ckpt.save(1, state(1.0)).durable.result(60)
      ckpt.save(2, state(2.0))
      with pytest.raises(sidecar.SidecarError):
        ckpt.wait()
      assert ckpt.all_steps() == [1]
      assert "2" not in os.listdir(directory)
  check_only_step_1(directory)
  assert shm_entries() == before and set(arena_mappers()) <= mappers


def test_trainer_killed_during_staging(tmp_path):
  """Killed in the middle of its copy of step 2 (before save() returns): the step was
  begun on host 0, never staged whole anywhere; it is swept, step 1 restores."""
  before, mappers = shm_entries(), set(arena_mappers())
  directory = tmp_path / "ck"
  script = textwrap.dedent(f"""
      import os, signal
      import jax, jax.numpy as jnp, numpy as np
      import sidecar
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      from sidecar._src.controller.checkpoint import staging
      c = sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB").start()
      ctl = c.controller()
      sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
      st = lambda v: {{"w": jax.device_put(jnp.full((256, 128), v, jnp.float32), sh),
                       "n": np.arange(4) + int(v)}}
      print(c.pid(0), c.pid(1), flush=True)
      ckpt = ctl.checkpointer({str(directory)!r})
      ckpt.save(1, st(1.0)).durable.result(60)
      copy, copied = staging.shm.copy, []
      def killed_mid_copy(dst, src, **kw):
        copied.append(src.nbytes)
        if len(copied) == 2:
          os.kill(os.getpid(), signal.SIGKILL)  # one shard of step 2 copied, not staged
        copy(dst, src, **kw)
      staging.shm.copy = killed_mid_copy
      ckpt.save(2, st(2.0))
  """)
  p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120,
                     stdout=subprocess.PIPE, text=True,
                     env=dict(os.environ, TMPDIR=str(tmp_path)))  # its dir stays there
  assert p.returncode == -signal.SIGKILL
  for pid in map(int, p.stdout.split()):  # its sidecars exit within a second
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
      time.sleep(0.05)
  check_only_step_1(directory)
  assert shm_entries() == before and set(arena_mappers()) <= mappers


def test_a_step_one_host_holds_is_committed_there_after_its_trainer_died(tmp_path):
  """One host: the trainer is SIGKILLed once step 2 is staged, while its write is held
  (the "slow" fault, until a file exists). The sidecar took it over: it commits step 2
  once written all the same (Status lists it as committing meanwhile), and a restarted
  trainer, opening the directory while it is written, waits for that commit and restores
  step 2 bit-exact from the RAM tier, data position too."""
  hold = tmp_path / "release"
  env = {"SIDECAR_CKPT_FAULT": f"slow@2:{hold}"}
  directory = tmp_path / "ck"
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    host_env={0: env}) as c:
    script = textwrap.dedent(f"""
        import os, signal
        import jax.numpy as jnp, numpy as np
        import sidecar
        ctl = sidecar.jax.Controller({c.addresses!r})
        ckpt = ctl.checkpointer({str(directory)!r})
        ckpt.save(1, {{"w": jnp.ones((256, 128)), "n": np.arange(4)}}).durable.result(60)
        ckpt.save(2, {{"w": jnp.full((256, 128), 2.0), "n": np.arange(4) + 2}},
                  data_state={{"position": 22}}).staged.result(60)
        signal.pause()  # staged, not written: killed there
    """)
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
      assert eventually(lambda: "step 2: taken over here" in c.log(0), timeout=60)
    finally:
      p.kill()
    assert p.wait(30) == -signal.SIGKILL
    with c.controller() as ctl:
      (status,) = [s.checkpoints[0] for s in ctl.status()]
      assert (status.writing, status.committing, status.uncommitted) == ([2], [2], [])  # held
      threading.Timer(1.0, hold.touch).start()  # released while the restart opens
      with ctl.checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        restored = ckpt.restore(target={"w": jnp.zeros((256, 128)), "n": np.zeros(4, int)})
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 128), 2.0))
        np.testing.assert_array_equal(restored["n"], np.arange(4) + 2)
        assert ckpt.data_state() == {"position": 22}
        assert ckpt.last_restore_stats().shards == {"ram:host0": 2}
    assert "step 2: committed by the sidecars' agreement (1 hosts)" in c.log(0)
