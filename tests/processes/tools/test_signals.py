"""Tier 3: signals to a LocalCluster's process and to a sidecar (issue 35 item 11)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import sidecar
from tests.conftest import alive, eventually, shm_entries
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

_HOLDER = textwrap.dedent("""
    import json, sys, time
    from sidecar._src.tools.local import LocalCluster
    cluster = LocalCluster(1, 1, shm_size="8MiB", configure_jax=False).start()
    print(json.dumps({"dir": cluster._dir, "pid": cluster.pid(0)}), flush=True)
    time.sleep(120)
""")


def test_sigterm_to_a_process_with_a_local_cluster_removes_its_directory_and_sidecars():
  before = shm_entries()
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER], cwd=ROOT, stdout=subprocess.PIPE,
                          text=True)
  try:
    started = json.loads(proc.stdout.readline())
    assert os.path.isdir(started["dir"]) and alive(started["pid"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM  # it still dies of SIGTERM, as without a cluster
  finally:
    proc.kill()
    proc.wait()
    proc.stdout.close()
  assert not os.path.exists(started["dir"])
  assert eventually(lambda: not alive(started["pid"]), 10)
  assert eventually(lambda: shm_entries() == before, 10)


def test_sighup_to_a_sidecar_is_logged_and_ignored():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB",
                                    configure_jax=False) as c:
    os.kill(c.pid(0), signal.SIGHUP)
    assert eventually(lambda: "SIGHUP" in c.log(0), 10), c.log(0)
    assert c.poll(0) is None
    with c.controller() as ctl:
      assert [h.host_id for h in ctl.hosts] == [0]
