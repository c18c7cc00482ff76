"""``sidecar slurm service|status|stop`` on a real single-node Slurm: a service of 2 array
tasks of sidecars, a client through its cluster.env, one task killed and requeued while
the client trains on, and a stop that leaves nothing behind; a task requeued while its
port is taken serves on a fresh one."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import sidecar
from tests.conftest import alive
from tests.support import pool_files
from tests.support.paths import ROOT
from tests.support.trainers import results

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]


def cli(slurm, env, *args, check=True):
  return subprocess.run([sys.executable, "-m", "sidecar", "slurm", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120, check=check)


def wait_for(path, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    assert time.monotonic() < deadline, f"{path} was not written in {timeout} s"
    time.sleep(0.2)


def test_a_service_serves_a_client_through_a_requeue_and_stops_clean(slurm, tmp_path,
                                                                     monkeypatch):
  home = tmp_path / "home"
  env = {**slurm.env, "SIDECAR_HOME": str(home), "JAX_PLATFORMS": "cpu"}
  started = cli(slurm, env, "service", "--name", "svc", "--nodes", "2", "--min-nodes", "2",
                "--shm-size", "64MiB", "--import", "tests.support.feed_fns",
                "--checkpoint-root", str(tmp_path))
  job = re.search(r"job (\d+)", started.stdout).group(1)
  cluster_file = home / "svc" / "cluster.env"
  wait_for(cluster_file)
  text = cluster_file.read_text()
  assert f"SIDECAR_SLURM_JOB={job}\n" in text and "SIDECAR_SERVICE=svc\n" in text
  assert oct((home / "svc" / "token").stat().st_mode & 0o777) == "0o600"

  # A client trains through it; host 1's sidecar dies at step 3 and its task is requeued.
  client = subprocess.run(
      [sys.executable, "-m", "tests.support.slurm_client", str(cluster_file),
       str(tmp_path / "ckpt"), "3"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  found = results(client.stdout)
  assert client.returncode == 0, client.stdout + client.stderr
  (hosts,) = [r for r in found if r["kind"] == "hosts"]
  assert hosts["hosts"] == [0, 1]
  (back,) = [r for r in found if r["kind"] == "back"]
  assert back["hosts"] == [0, 1], client.stdout
  (final,) = [r for r in found if r["kind"] == "final"]
  assert final["hosts"] == [0, 1]  # grown back to both
  assert sorted(map(int, final["seen"])) == list(range(1, 9))
  want = np.sum([final["seen"][str(s)] for s in range(1, 9)], axis=0)
  np.testing.assert_array_equal(final["w"], want)  # bit-exact through the loss and regrow
  kinds = final["events"]
  assert kinds.index("host_lost") < kinds.index("retry") < kinds.index("host_back") \
      < kinds.index("grow")
  log = (home / "svc" / "service.log").read_text()
  assert "sidecar host 1 (node" in log and "requeueing array task 1" in log, log
  # The requeued task's sidecar is a new process at the old address.
  entries = {h: e for h, e in enumerate(cluster_file.read_text().split("SIDECAR_HOSTS=")[1]
                                        .splitlines()[0].split(","))}
  assert entries == dict(enumerate(text.split("SIDECAR_HOSTS=")[1].splitlines()[0].split(",")))

  shown = cli(slurm, env, "status", "svc", check=False)
  assert shown.returncode == 0, shown.stdout + shown.stderr
  assert f"service job {job}" in shown.stdout and "RUNNING" in shown.stdout
  assert "host 0" in shown.stdout and "host 1" in shown.stdout, shown.stdout

  saved = cluster_file.read_text()
  entries = [json.loads((home / "svc" / "hosts" / f).read_text())
             for f in os.listdir(home / "svc" / "hosts") if f.endswith(".json")]
  assert len(entries) == 2
  stopped = cli(slurm, env, "stop", "svc")
  assert "stopped" in stopped.stdout
  assert slurm.jobs() == []
  # Nothing is left: the service's directory, the sidecars, their sockets' directories.
  assert not (home / "svc").exists()
  assert not any(alive(e["pid"]) for e in entries)
  assert not any(os.path.exists(os.path.dirname(e["socket"])) for e in entries)

  # A cluster file whose job has ended: the client says which job and that it is gone.
  stale = tmp_path / "stale.env"
  stale.write_text(saved)
  monkeypatch.setenv("SLURM_CONF", slurm.conf)
  with pytest.raises(sidecar.DiscoveryError,
                     match=f"cluster file {stale} names Slurm job {job} \\(service 'svc'\\), "
                           "which is gone"):
    sidecar.jax.Controller.from_cluster_file(str(stale))


def hosts_of(cluster_file) -> list[str]:
  text = cluster_file.read_text()
  return text.split("SIDECAR_HOSTS=")[1].splitlines()[0].split(",")


def test_a_requeued_task_whose_port_was_taken_serves_on_a_fresh_one(slurm, tmp_path):
  # Issue 35 item 6: the task used to reuse its old port, fail at once while anyone held
  # it, and be requeued onto it again, for as long as it was held.
  home = tmp_path / "home"
  env = {**slurm.env, "SIDECAR_HOME": str(home), "JAX_PLATFORMS": "cpu"}
  cli(slurm, env, "service", "--name", "busy", "--shm-size", "64MiB",
      "--checkpoint-root", str(tmp_path))
  cluster_file = home / "busy" / "cluster.env"
  try:
    wait_for(cluster_file)
    (before,) = hosts_of(cluster_file)
    port = int(before.rsplit(":", 2)[1])
    pid = json.loads((home / "busy" / "hosts" / "0.json").read_text())["pid"]
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with holder:
      os.kill(pid, signal.SIGKILL)
      deadline = time.monotonic() + 30
      while True:  # the port, once the killed sidecar lets it go
        try:
          holder.bind(("0.0.0.0", port))
          break
        except OSError:
          assert time.monotonic() < deadline, f"port {port} was not let go in 30 s"
          time.sleep(0.05)
      holder.listen()
      deadline = time.monotonic() + 90
      while hosts_of(cluster_file) == [before]:
        assert time.monotonic() < deadline, (
            "cluster.env still names the taken port after 90 s; the service's log:\n"
            + (home / "busy" / "service.log").read_text())
        time.sleep(0.2)
      (after,) = hosts_of(cluster_file)
      assert after.rsplit(":", 2)[0] == before.rsplit(":", 2)[0]  # the same node
      assert int(after.rsplit(":", 2)[1]) != port
      shown = cli(slurm, env, "status", "busy", check=False)  # a client reaches it there
      assert shown.returncode == 0, shown.stdout + shown.stderr
      assert re.search(rf"^{re.escape(after.rsplit(':', 1)[0])} +0 ", shown.stdout, re.M), \
          shown.stdout
      log = (home / "busy" / "service.log").read_text()
      assert log.count("requeueing array task 0") == 1, log  # once: no crash loop
      task_log = (home / "busy" / "logs" / "task-0.log").read_text()
      assert f"host 0's port {port} on node" in task_log and "is taken" in task_log, task_log
  finally:
    cli(slurm, env, "stop", "busy", check=False)
  assert slurm.jobs() == []
  assert not (home / "busy").exists()


def test_a_service_serves_a_pool_of_tenants(slurm, tmp_path):
  """``--pool FILE`` (issue 37): every sidecar serves the pool's tenants with their own
  tokens, not the service's; its status asks with the pool's operator token, which the
  service made, and sees every tenant's row."""
  home = tmp_path / "home"
  env = {**slurm.env, "SIDECAR_HOME": str(home), "JAX_PLATFORMS": "cpu"}
  pool = pool_files.write_pool(tmp_path)
  bad = cli(slurm, env, "service", "--name", "pool", "--pool", str(tmp_path / "none.yaml"),
            check=False)
  assert bad.returncode == 2 and "--pool " + str(tmp_path / "none.yaml") in bad.stderr
  cli(slurm, env, "service", "--name", "pool", "--shm-size", "64MiB",
      "--import", "tests.support.sidecar_fns", "--checkpoint-root", str(tmp_path),
      "--pool", os.path.relpath(pool, ROOT))  # made absolute: the tasks run elsewhere
  cluster_file = home / "pool" / "cluster.env"
  try:
    wait_for(cluster_file)
    spec = json.loads((home / "pool" / "service.json").read_text())
    assert spec["pool"] == pool
    (entry,) = hosts_of(cluster_file)
    host = entry.rsplit(":", 1)[0]  # host:port (its health port after)
    with sidecar.jax.Controller([host], token=pool_files.ALICE, attach=False, timeout=30) as ctl:
      assert ctl.call("add", args=(1,), kwargs={"b": 2}) == [3]
    service_token = (home / "pool" / "token").read_text().strip()
    with pytest.raises(sidecar.AuthenticationError):
      sidecar.jax.Controller([host], token=service_token, attach=False, timeout=30)
    # Issue 42's gap (e): the service makes the pool's operator token, kept as the
    # tenants' (0600, in its directory), and gives it to every sidecar: it reads each
    # tenant's row, which the peer token (all status had before) no longer sees.
    operator = home / "pool" / "operator-token"
    assert operator.stat().st_mode & 0o777 == 0o600
    with sidecar.jax.Controller([host], token=operator.read_text().strip(), attach=False,
                            timeout=30) as op:
      assert sorted(t.name for t in op.status()[0].tenants) == ["alice", "bob"]
    shown = cli(slurm, env, "status", "pool", check=False)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert re.search(rf"^{re.escape(host)} +0 ", shown.stdout, re.M), shown.stdout
    assert re.search(r"^0 +alice ", shown.stdout, re.M), shown.stdout  # the tenants' rows
  finally:
    cli(slurm, env, "stop", "pool", check=False)
  assert slurm.jobs() == []
  assert not (home / "pool").exists()
