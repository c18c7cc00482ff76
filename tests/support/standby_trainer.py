"""A trainer for ``sidecar launch --standby``: says what its process saw, then fails on cue.

Run as ``sidecar launch --hosts H --max-restarts K --standby --preload
tests.support.standby_preload -- python -m tests.support.standby_trainer DIR
[--kill-standbys]``
(or by this file's path). Each process prints one ``RESULT {json}`` line: its pid, start
count, process id, ``SIDECAR_STARTED``, when the preloaded module was imported (None:
it was not), its ``sys.argv`` and ``sys.path[0]``, what stdin held, and when the kernel
says the process began. Then, on the first start (``SIDECAR_RESTART`` 0) process 1 exits
with code 3, once process 0 has printed (a file in DIR says so) (with
``--kill-standbys``, after SIGKILLing the launcher's waiting standby processes: the
restart must start fresh ones); on the second it SIGKILLs itself;
process 0 waits to be stopped. On later starts every process exits 0.
"""

import json
import os
import signal
import sys
import time

STANDBY_NAME = "sidecar-standby"


def _standbys() -> list[int]:
  """The launcher's waiting standby processes (this one's siblings by name)."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/comm") as f:
        name = f.read().strip()
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    if name == STANDBY_NAME and ppid == os.getppid():
      out.append(int(entry))
  return out


def main(argv: list[str]) -> int:
  from sidecar._src.controller import goodput

  restart = int(os.environ["SIDECAR_RESTART"])
  me = int(os.environ["SIDECAR_PROCESS_ID"])
  preload = sys.modules.get("tests.support.standby_preload")
  started = os.environ.get("SIDECAR_STARTED")
  kernel_start = goodput.process_start(os.getpid())  # by pid: the kernel's, whatever the env
  print("RESULT " + json.dumps({
      "pid": os.getpid(), "restart": restart, "process": me, "started": started,
      "ledger_start": goodput.process_start(), "kernel_start": kernel_start,
      "preloaded_at": None if preload is None else preload.IMPORTED_AT,
      "exported_at_import": os.environ.get("TEST_EXPORTED_AT_IMPORT"),
      "set_by_env": os.environ.get("TEST_SET_BY_ENV"),
      "argv": sys.argv, "path0": sys.path[0], "stdin": sys.stdin.read(),
      "now": time.time()}), flush=True)
  printed = os.path.join(argv[0], f"printed-{restart}")
  if me == 0:
    open(printed, "w").close()
  if restart >= 2:
    return 0
  if me != 1:
    time.sleep(120)  # until the launcher stops this start
    return 1
  deadline = time.monotonic() + 60
  while not os.path.exists(printed) and time.monotonic() < deadline:
    time.sleep(0.01)
  if restart == 0:
    if "--kill-standbys" in argv:  # every rank's, once each has named itself
      ranks = int(os.environ["SIDECAR_NUM_PROCESSES"])
      while len(_standbys()) < ranks and time.monotonic() < deadline:
        time.sleep(0.01)
      for pid in _standbys():
        os.kill(pid, signal.SIGKILL)
    return 3
  os.kill(os.getpid(), signal.SIGKILL)
  return 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
