"""Issue 76, attack 5: sessions whose pid the next trainer life gets, from outside.

Run as the first process of a PID namespace of its own (``unshare --pid --fork
--mount-proc python -m tests.support.pid_reuse attack DIR``), where this process alone
decides which pid the next process gets (``/proc/sys/kernel/ns_last_pid``): the pid counter
"turned around" without waiting for 32768 processes. It starts ``sidecar launch
--stall-timeout 1 --max-restarts 1`` of this module's trainer (``trainer DIR``), and while
the trainer's first life runs it opens :data:`SESSIONS` worker sessions, each from a process
that connects to the sidecar's worker socket, hands its connection to this one (SCM_RIGHTS)
and exits: each session claims rank 0 of the next start (``restart`` 1), says its startup
ended (its stall clock runs) and then says nothing, so it is stalled a second later, listed
with the pid of a process that is gone. Then it points the pid counter just before those
pids and lets the first life exit: the launcher's next life gets one of them. That life
waits :data:`ATTACH_AFTER_S` before it attaches (a JAX import, a slow disk), then attaches
and ends well.

Prints ``RESULT {json}``: the launcher's exit code, the sessions' pids, the next life's pid
(and whether it is one of them: the scenario happened) and whether it ended well.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

SESSIONS = 96
ATTACH_AFTER_S = 4.0


def trainer(directory: str) -> int:
  d = pathlib.Path(directory)
  restart = os.environ.get("SIDECAR_RESTART", "0")
  (d / f"life{restart}.pid").write_text(str(os.getpid()))
  if restart == "0":
    (d / "address").write_text(os.environ["SIDECAR_ADDRESS"])
    while not (d / "go").exists():
      time.sleep(0.05)
    return 3  # a crash: the launcher starts the next life
  time.sleep(ATTACH_AFTER_S)  # not attached yet: no session of its own
  import sidecar
  worker = sidecar.Worker()
  worker.close()
  (d / "done").write_text("ok")
  return 0


def _session(path: str, hello: dict) -> tuple[socket.socket, int]:
  """A worker session attached by a process that is gone: its connection, its pid."""
  from sidecar._src.wire import ipc
  ours, theirs = socket.socketpair()
  pid = os.fork()  # no thread runs in this process: a plain fork is safe
  if pid == 0:
    try:
      conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      conn.connect(path)
      socket.send_fds(theirs, [b"x"], [conn.fileno()])
    finally:
      os._exit(0)
  os.waitpid(pid, 0)
  _, fds, _, _ = socket.recv_fds(ours, 1, 1)
  ours.close()
  theirs.close()
  conn = socket.socket(fileno=fds[0])
  ipc.send(conn, hello)
  reply, arena = ipc.recv(conn, max_fds=1)
  for fd in arena:
    os.close(fd)
  assert "session" in reply, reply
  ipc.send(conn, {"op": "phase", "name": "startup", "budget_s": None})  # its clock runs
  return conn, pid


def attack(directory: str) -> int:
  from sidecar._src.wire import protocol
  d = pathlib.Path(directory)
  log = open(d / "launch.log", "wb")
  launcher = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "16MiB",
       "--stall-timeout", "1", "--max-restarts", "1", "--", sys.executable, "-m",
       "tests.support.pid_reuse", "trainer", directory], stdout=log, stderr=subprocess.STDOUT)
  deadline = time.monotonic() + 120
  while not (d / "address").exists():
    if launcher.poll() is not None or time.monotonic() > deadline:
      raise SystemExit(f"the first life never started: {(d / 'launch.log').read_text()}")
    time.sleep(0.05)
  path = (d / "address").read_text().removeprefix("unix://")
  hello = {"op": "attach", "versions": protocol.versions_dict(protocol.local_versions()),
           "rank": 0, "restart": 1}
  held, pids = [], []
  for _ in range(SESSIONS):
    conn, pid = _session(path, hello)
    held.append(conn)
    pids.append(pid)
  time.sleep(2.0)  # past the stall timeout: every session is stalled
  with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(min(pids) - 1))  # the counter turned around: the next pid is theirs
  (d / "go").write_text("")
  code = launcher.wait(timeout=120)
  for conn in held:
    conn.close()
  life1 = d / "life1.pid"
  pid = int(life1.read_text()) if life1.exists() else None
  print("RESULT " + json.dumps({"code": code, "pids": pids, "life1": pid,
                                "reused": pid in pids, "done": (d / "done").exists()}),
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit({"attack": attack, "trainer": trainer}[sys.argv[1]](sys.argv[2]))
