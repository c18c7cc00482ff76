"""SIGKILL at every phase of a save: the previous step restores bit-exact, nothing leaks."""

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
  before, mappers = shm_entries(), set(arena_mappers())
  directory = tmp_path / "ck"
  script = textwrap.dedent(f"""
      import os, signal
      import jax, jax.numpy as jnp, numpy as np
      import sidecar
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      c = sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB").start()
      ctl = c.controller()
      sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
      st = lambda v: {{"w": jax.device_put(jnp.full((256, 128), v, jnp.float32), sh),
                       "n": np.arange(4) + int(v)}}
      print(c.pid(0), c.pid(1), flush=True)
      ckpt = ctl.checkpointer({str(directory)!r})
      ckpt.save(1, st(1.0)).durable.result(60)
      ckpt.save(2, st(2.0))
      os.kill(os.getpid(), signal.SIGKILL)  # before step 2 is staged or written
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


def test_a_step_staged_by_a_controller_that_dies_before_its_commit_is_freed(tmp_path):
  """The trainer is SIGKILLed once step 2 is staged, while its write is slowed (the
  "slow" fault): the sidecars finish writing it, nobody commits it; it is listed as
  uncommitted, then freed after SIDECAR_UNCOMMITTED_TIMEOUT."""
  # 6 s: long enough that, at a load of 8, the controller below still sees step 2 held.
  env = {"SIDECAR_UNCOMMITTED_TIMEOUT": "6", "SIDECAR_CKPT_FAULT": "slow@2"}
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                    host_env={0: env, 1: env}) as c:
    script = textwrap.dedent(f"""
        import os, signal
        import jax, jax.numpy as jnp, numpy as np
        import sidecar
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        ctl = sidecar.jax.Controller({c.addresses!r})
        sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
        ckpt = ctl.checkpointer({str(tmp_path / "ck")!r})
        ckpt.save(1, {{"w": jax.device_put(jnp.ones((256, 128)), sh)}}).durable.result(60)
        ckpt.save(2, {{"w": jax.device_put(jnp.zeros((256, 128)), sh)}}).staged.result(60)
        os.kill(os.getpid(), signal.SIGKILL)  # staged, not written, never committed
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120,
                       env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    assert p.returncode == -signal.SIGKILL
    with c.controller() as ctl:
      def held():
        return {s.identity.host_id: (list(s.checkpoints[0].uncommitted), s.arena_used)
                for s in ctl.status() if s.checkpoints}
      assert eventually(lambda: [u for u, _ in held().values()] == [[2], [2]], timeout=30)
      used = {h: n for h, (_, n) in held().items()}
      assert eventually(lambda: [u for u, _ in held().values()] == [[], []], timeout=30)
      assert all(n < used[h] for h, (_, n) in held().items())  # step 2's blocks came back
      assert "never committed" in c.log(0)


def test_a_step_one_host_holds_is_committed_there_after_its_trainer_died(tmp_path):
  """One host: the trainer is SIGKILLed once step 2 is staged, while its write is held
  (the "slow" fault, until a file exists). The sidecar commits step 2 once written all the
  same, and a restarted trainer, opening the directory while it is written, waits for
  that commit and restores step 2 bit-exact from the RAM tier, data position too."""
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
      assert eventually(lambda: "step 2: to be committed here once written" in c.log(0),
                        timeout=60)
    finally:
      p.kill()
    assert p.wait(30) == -signal.SIGKILL
    with c.controller() as ctl:
      assert [s.checkpoints[0].writing for s in ctl.status()] == [[2]]  # held
      threading.Timer(1.0, hold.touch).start()  # released while the restart opens
      with ctl.checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        restored = ckpt.restore(target={"w": jnp.zeros((256, 128)), "n": np.zeros(4, int)})
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 128), 2.0))
        np.testing.assert_array_equal(restored["n"], np.arange(4) + 2)
        assert ckpt.data_state() == {"position": 22}
        assert ckpt.last_restore_stats().shards == {"ram:host0": 2}
    assert "committed here once written" in c.log(0)
