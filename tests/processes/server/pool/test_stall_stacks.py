"""Tier 3: ``sidecar stalls --stacks`` in a pool signals only verified processes of the
caller's own tenant (issue 69, item 2). A tenant's worker attaches claiming the pid of a
process that is not its own (another tenant's trainer, say) and stalls; the probe asks
stacks only of the process the kernel says attached, with that tenant's token, and of
none with the operator's."""

import inspect
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from sidecar._src.controller import status as status_lib
from tests.conftest import eventually
from tests.support.paths import ROOT
from tests.support.pool_files import ALICE, OPERATOR, OPERATOR_LINE, POOL, write_pool

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

# A process that writes MARK once it is sent SIGUSR2 (the stacks signal), after attaching
# to the worker socket SOCKET with TOKEN and claiming pid CLAIM where those are given.
PROCESS = """
import os, signal, sys, time
mark, socket_path, token, claim = (sys.argv[1:] + ["", "", ""])[:4]
signal.signal(signal.SIGUSR2, lambda *_: open(mark, "w").close())
if socket_path:
  import socket
  from sidecar._src.wire import ipc, protocol
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.connect(socket_path)
  ipc.send(sock, {"op": "attach", "pid": int(claim), "token": token, "rank": 0, "restart": 0,
                  "versions": protocol.versions_dict(protocol.local_versions())})
  reply, _ = ipc.recv(sock, max_fds=1)
  assert "session" in reply, reply
print("ready", flush=True)
time.sleep(600)
"""


def start(mark: pathlib.Path, *args: str) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", PROCESS, str(mark), *args],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert proc.stdout.readline() == "ready\n"
  return proc


def first_step(steps, session: str) -> None:
  """Starts ``session``'s stall clock: its first step (its second save, once the clock
  starts only after a trainer's startup: issue 69, item 1)."""
  if "saves" in inspect.signature(steps.step).parameters:
    steps.step(session, saves=2)
  else:
    steps.step(session)


def stalls(address: str, token: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "sidecar", "stalls", address, "--stacks"],
                        cwd=ROOT, capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, PYTHONPATH=str(ROOT), SIDECAR_TOKEN=token,
                                 SIDECAR_STACKS_SIGNAL="SIGUSR2"))


def test_stalls_stacks_signals_only_the_verified_process_of_the_callers_tenant(
    make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, POOL + OPERATOR_LINE), stall_timeout_s=0.2)
  victim = start(tmp_path / "victim")  # no session of alice's: another tenant's trainer
  attacker = start(tmp_path / "attacker", server.options.socket_path, ALICE, str(victim.pid))
  try:
    [session] = server.workers.pids()
    first_step(server.workers.steps, session)  # then none: stalled

    def stalled():
      got = status_lib.fetch(server.address, timeout=10, token=ALICE).trainers
      return len(got) == 1 and got[0].stalled
    assert eventually(stalled, timeout=30)
    [t] = status_lib.fetch(server.address, timeout=10, token=ALICE).trainers
    assert (t.pid, t.pid_verified, t.tenant) == (attacker.pid, True, "alice")

    # The operator sees alice's trainer stalled, and signals no tenant's.
    by_operator = stalls(server.address, OPERATOR)
    assert by_operator.returncode == 1, by_operator
    assert f"pid {attacker.pid}" in by_operator.stdout
    assert "it is tenant 'alice''s trainer, and this token is no tenant's" in by_operator.stdout
    # Alice's token: the stacks of the process that attached, never of the one it claimed.
    by_alice = stalls(server.address, ALICE)
    assert by_alice.returncode == 1, by_alice
    assert "rank 0 stalled: no step for" in by_alice.stdout
    assert eventually(lambda: (tmp_path / "attacker").exists(), timeout=10)
    assert not (tmp_path / "victim").exists()
    assert victim.poll() is None and attacker.poll() is None
  finally:
    for proc in (victim, attacker):
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=30)
      proc.stdout.close()
