"""Tier 3: LocalCluster, real sidecar processes; SIGKILL of sidecars and workers."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import jax
import numpy as np
import pytest

import sidecar
from sidecar._src.tools import local as local_lib
from tests.conftest import alive, arena_mappers, eventually, shm_entries
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

FNS = ["tests.support.sidecar_fns"]


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=4, devices_per_host=2, shm_size="32MiB",
                                    imports=FNS) as c:
    yield c


def test_hosts_identity_and_devices(cluster):
  with cluster.controller() as ctl:
    assert [h.host_id for h in ctl.hosts] == [0, 1, 2, 3]
    assert [h.device_ids for h in ctl.hosts] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert len({h.pid for h in ctl.hosts}) == 4 and all(h.pid != os.getpid() for h in ctl.hosts)
    assert [d.id for d in cluster.devices(2)] == [4, 5]
    assert len(jax.devices()) >= 8


def test_call_runs_on_chosen_hosts_in_their_order(cluster):
  with cluster.controller() as ctl:
    pids = {h.host_id: h.pid for h in ctl.hosts}
    got = ctl.call("identity_env", hosts=[3, 1])
    assert [g["pid"] for g in got] == [pids[3], pids[1]]
    futures = ctl.call_async("add", args=(1,), kwargs={"b": 2})
    assert [f.result(10) for f in futures] == [3] * 4


def test_arrays_reach_jax_from_every_host(cluster):
  with cluster.controller() as ctl:
    parts = ctl.call("full", args=(1 << 20, 5))
    for h, part in enumerate(parts):
      assert np.shares_memory(part, ctl.worker(h).arena.buffer)
      x = ctl.worker(h).to_jax(part, device=cluster.devices(h)[0])
      assert x.devices() == {cluster.devices(h)[0]} and int(x.sum()) == 5 << 20


def test_sidecar_killed_mid_call_raises_host_lost_naming_it():
  mappers = set(arena_mappers())
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                    imports=FNS) as c, c.controller(timeout=30) as ctl:
    f = ctl.call_async("sleep", args=(20,), hosts=[1])[0]
    time.sleep(0.3)
    t0 = time.monotonic()
    c.kill(1)
    with pytest.raises(sidecar.HostLostError, match=r"host 1") as info:
      f.result(25)
    assert info.value.host_id == 1 and time.monotonic() - t0 < 10
    assert ctl.call("add", args=(1,), hosts=[0]) == [1]  # the other host is unaffected
    with pytest.raises(sidecar.HostLostError):
      ctl.call("die", hosts=[0])  # a function that kills its own sidecar
  assert set(arena_mappers()) <= mappers


def _worker_script(sock: str) -> str:
  return textwrap.dedent(f"""
      import os, sys, time
      from sidecar._src.arena.worker import Worker
      w = Worker({sock!r})
      held = [w.empty((1 << 20,), "uint8")[0] for _ in range(3)]
      for a in held:
        a[:] = 7
      print("held", flush=True)
      time.sleep(60)
  """)


def _spawn_worker(sock: str) -> subprocess.Popen:
  p = subprocess.Popen([sys.executable, "-c", _worker_script(sock)], stdout=subprocess.PIPE,
                       text=True, cwd=ROOT)
  assert p.stdout.readline().strip() == "held"
  return p


def _arena_used(ctl, host):
  return ctl.status()[host].arena_used


@pytest.mark.parametrize("victims", ["worker", "sidecar", "both"])
def test_kill_9_leaves_no_shared_memory(victims):
  before, mappers = shm_entries(), set(arena_mappers())
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=FNS) as c:
    worker = _spawn_worker(c.socket(0))
    sidecar_pid = c.pid(0)
    assert sidecar_pid in arena_mappers() and worker.pid in arena_mappers()
    with c.controller(attach=False) as ctl:
      assert _arena_used(ctl, 0) == 3 << 20
      if victims in ("worker", "both"):
        worker.send_signal(signal.SIGKILL)
        worker.wait()
      if victims == "worker":
        assert eventually(lambda: _arena_used(ctl, 0) == 0)  # the dead worker's blocks went back
        assert ctl.call("add", args=(1,)) == [1]
      if victims in ("sidecar", "both"):
        c.kill(0)
    if victims == "sidecar":
      # The worker still maps the arena and its data is intact; the memory lives on with it.
      assert worker.pid in arena_mappers()
      worker.send_signal(signal.SIGKILL)
      worker.wait()
  assert shm_entries() == before
  # No process of this test maps an arena: the memory went back to the kernel.
  assert set(arena_mappers()) <= mappers


def test_cluster_cleans_up_when_the_body_raises():
  mappers = set(arena_mappers())
  with pytest.raises(RuntimeError, match="body failed"):
    with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB") as c:
      pids = [c.pid(h) for h in range(2)]
      raise RuntimeError("body failed")
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)
  assert set(arena_mappers()) <= mappers


def test_sidecar_that_cannot_get_its_arena_fails_at_start_with_the_fix():
  with pytest.raises(sidecar.HostLostError, match=r"needs .* but only .* available.*--shm-size"):
    with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64TiB"):
      pass


def test_bad_import_fails_at_start_naming_the_module():
  with pytest.raises(sidecar.HostLostError, match="cannot import 'no_such_module_xyz'"):
    with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB",
                                      imports=["no_such_module_xyz"]):
      pass


def test_sidecars_exit_when_the_trainer_is_killed(tmp_path):
  mappers = set(arena_mappers())
  script = textwrap.dedent("""
      import sidecar
      c = sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB").start()
      print(c.pid(0), c.pid(1), flush=True)
      import time; time.sleep(60)
  """)
  trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT,
                             env=dict(os.environ, TMPDIR=str(tmp_path)))  # its dir stays there
  pids = [int(p) for p in trainer.stdout.readline().split()]
  trainer.send_signal(signal.SIGKILL)
  trainer.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and any(alive(p) for p in pids):
    time.sleep(0.05)
  assert not any(alive(p) for p in pids)
  assert set(arena_mappers()) <= mappers


def test_a_later_start_removes_the_directory_of_a_killed_cluster(monkeypatch):
  # issue 35 item 14: a SIGKILLed `sidecar local` left /tmp/sidecar-local-* behind for good.
  # A short temp dir: under a long one (pytest's under xdist) the sockets go to /tmp.
  base = pathlib.Path(tempfile.mkdtemp(prefix="sc-", dir="/tmp"))
  proc = None
  try:
    live = base / "sidecar-local-live"  # a live process's (ours): never touched
    live.mkdir()
    (live / "owner.json").write_text(json.dumps(local_lib._owner()))
    unowned = base / "sidecar-local-unowned"  # no owner file: not known to be ours
    unowned.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "local", "--hosts", "1"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, TMPDIR=str(base)))
    first = proc.stdout.readline()
    directory = os.path.dirname(first.split("unix://")[1].split()[0])
    assert directory.startswith(str(base / "sidecar-local-")), first
    while "Ctrl-C" not in proc.stdout.readline():
      pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(os.path.join(directory, "host0.json")) as f:
      pid = json.load(f)["pid"]
    assert eventually(lambda: not alive(pid), timeout=10)  # --exit-with-parent
    assert os.path.isdir(directory)  # SIGKILL ran no cleanup
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB",
                                      configure_jax=False) as c:
      assert not os.path.exists(directory)
      assert live.is_dir() and unowned.is_dir()
      assert c._dir != directory and os.path.dirname(c._dir) == str(base)
    assert not os.path.exists(directory)
  finally:
    if proc is not None:
      proc.kill()  # a failed check before the SIGKILL leaves no sidecar behind
      proc.wait()
      proc.stdout.close()
    shutil.rmtree(base, ignore_errors=True)


def test_controller_from_env_discovers_every_sidecar(cluster, monkeypatch):
  hosts = ",".join(cluster.host_entry(h) for h in range(cluster.num_hosts))
  assert all(a.startswith("unix:/") for a in cluster.addresses)
  monkeypatch.setenv("SIDECAR_HOSTS", hosts)
  with sidecar.jax.Controller.from_env(timeout=10) as ctl:
    assert [h.address for h in ctl.hosts] == cluster.addresses
  monkeypatch.setenv("SIDECAR_HOSTS", hosts + ",127.0.0.1:1:2")
  with pytest.raises(sidecar.DiscoveryError,
                     match=r"(?s)1 of 5 sidecars did not answer.*host 4 \(127\.0\.0\.1:2\)"):
    sidecar.jax.Controller.from_env(timeout=1)
