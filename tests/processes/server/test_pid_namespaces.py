"""Tier 3: a worker's pid across PID namespaces (issue 69, item 2). The sidecar lists the
pid the kernel gives it (``SO_PEERCRED``): a worker in a namespace its own contains is
listed by its pid there, whatever it claims; one the kernel gives no pid for (the sidecar
in a namespace of its own, as a pod's containers without ``shareProcessNamespace``) is
listed unverified, 0. Needs ``unshare -pf`` (root, or user namespaces): skipped without."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from sidecar._src.controller import status as status_lib
from sidecar._src.wire import ipc, protocol
from tests.conftest import eventually
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def _unshare_works() -> bool:
  if shutil.which("unshare") is None:
    return False
  done = subprocess.run(["unshare", "-pf", "true"], capture_output=True, timeout=30)
  return done.returncode == 0


needs_unshare = pytest.mark.skipif(not _unshare_works(),
                                   reason="unshare -pf is not permitted here")
# A worker that attaches to the worker socket argv[1] claiming its own pid (1, in a PID
# namespace of its own), says so, and stays attached.
WORKER = """
import os, socket, sys, time
from sidecar._src.wire import ipc, protocol
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
ipc.send(sock, {"op": "attach", "pid": os.getpid(),
                "versions": protocol.versions_dict(protocol.local_versions())})
reply, _ = ipc.recv(sock, max_fds=1)
print("attached" if "session" in reply else reply, os.getpid(), flush=True)
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(c) for c in f.read().split()]
  except OSError:
    return []


@needs_unshare
def test_a_worker_in_a_child_pid_namespace_is_listed_by_its_pid_here(make_server):
  server = make_server()
  worker = subprocess.Popen(["unshare", "-pf", "--kill-child", sys.executable, "-c", WORKER,
                             server.options.socket_path], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  try:
    assert worker.stdout.readline().split() == ["attached", "1"]  # its own view: pid 1
    [child] = _children(worker.pid)
    [t] = status_lib.fetch(server.address, timeout=10).trainers
    assert (t.pid, t.pid_verified) == (child, True)  # this namespace's, signallable
  finally:
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    worker.stdout.close()


@needs_unshare
def test_a_worker_the_kernel_gives_no_pid_for_is_listed_unverified(tmp_path):
  ready, path = tmp_path / "ready.json", str(tmp_path / "s.sock")
  env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
  serve = subprocess.Popen(
      ["unshare", "-pf", "--kill-child=SIGTERM", sys.executable, "-m", "sidecar", "serve",
       "--port", "0", "--health-port", "0", "--socket", path, "--shm-size", "8MiB",
       "--ready-file", str(ready)], env=dict(env, PYTHONPATH=str(ROOT)), cwd=ROOT,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    assert eventually(lambda: ready.exists() or serve.poll() is not None, timeout=60)
    assert serve.poll() is None, serve.stderr.read()[-2000:]
    address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # from outside its namespace
      sock.connect(path)
      ipc.send(sock, {"op": "attach", "pid": os.getpid(),
                      "versions": protocol.versions_dict(protocol.local_versions())})
      reply, fds = ipc.recv(sock, max_fds=1)
      for fd in fds:
        os.close(fd)
      assert "session" in reply, reply
      got = status_lib.fetch(address, timeout=10)
      [t] = got.trainers
      assert (t.pid, t.pid_verified) == (0, False)  # never the pid it claimed
      assert got.identity.pid_namespace not in ("", ipc.pid_namespace())
  finally:  # unshare passes no SIGTERM on: the sidecar is its child
    for child in _children(serve.pid):
      os.kill(child, signal.SIGTERM)
    try:
      _, err = serve.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      serve.kill()
      _, err = serve.communicate(timeout=30)
  assert "worker pid unverified attached as w-" in err, err[-2000:]
  assert "(it claimed pid " in err and "the kernel gives none: another PID namespace" in err
