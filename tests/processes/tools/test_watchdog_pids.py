"""``sidecar launch``'s watchdog signals only processes the launcher started (issue 69): a
stall a sidecar lists with a pid outside the process group of the trainer the launcher
started for that rank (another process, a negative pid naming a group, 0, an impossible
pid, another user's process) is said once and never acted on; the trainer's own pid is,
after one more look. Real processes; the sidecar's Status is faked at the one seam the
watchdog reads (its last listing, ``refresh``), and the signals it sends are recorded
(one to a pid <= 0 is never let through: see ``signals``)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from sidecar._src.tools import trainers, watchdog
from sidecar._src.wire.protocol import pb
from tests.support.paths import ROOT
from tests.support.trainers import results

pytestmark = [pytest.mark.processes, pytest.mark.timeout(200)]


@pytest.fixture
def processes():
  """Two processes, each leading its own session and process group (as a trainer that
  ``sidecar launch`` started): the trainer, and an unrelated one."""
  made = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                           start_new_session=True) for _ in range(2)]
  yield made
  for p in made:
    p.kill()
    p.wait()


@pytest.fixture(autouse=True)
def signals(monkeypatch):
  """Every signal the watchdog sends, recorded; one to a pid <= 0 (a process group, or
  every process this user may signal: as root, the machine's) is never let through, so
  that a regression of the rule fails here instead of killing the test run."""
  sent = []

  def kill(pid, sig):
    sent.append((pid, sig))
    if pid <= 0:
      raise PermissionError(f"the test refuses to signal pid {pid}")
    real_kill(pid, sig)

  def killpg(pgid, sig):
    sent.append((-pgid, sig))
    if pgid <= 0:
      raise PermissionError(f"the test refuses to signal group {pgid}")
    real_killpg(pgid, sig)

  real_kill, real_killpg = os.kill, os.killpg
  monkeypatch.setattr(watchdog.os, "kill", kill)
  monkeypatch.setattr(trainers.os, "killpg", killpg)
  return sent


def _stalled(pid: int) -> pb.TrainerStatus:
  return pb.TrainerStatus(pid=pid, rank=0, restart=0, steps=5, since_step_s=30.0,
                          stall_timeout_s=10.0, stalled=True)


class Listed(watchdog.Watchdog):
  """A watchdog whose sidecar lists ``first``, then ``again`` at the next look."""

  def __init__(self, first, again=None):
    self.said: list[str] = []
    super().__init__(lambda: {}, token=None, say=self.said.append)
    self._latest[0] = [first]
    self._read_at[0] = time.monotonic()  # as read now: its "no step for" grows from here
    self._again = again

  def refresh(self, hosts=None) -> None:
    if self._again is not None:
      self._latest[0] = [self._again]


@pytest.fixture
def other_user():
  """A process of another user: started as ``nobody`` where this test runs as root (CI),
  else one found in /proc; None where there is neither."""
  if os.getuid() == 0:
    proc = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    try:
      yield proc.pid
    finally:
      proc.kill()
      proc.wait()
    return
  yield next((int(name) for name in os.listdir("/proc")
              if name.isdigit() and os.stat(f"/proc/{name}").st_uid != os.getuid()), None)


@pytest.mark.parametrize("claim", ["unrelated", "minus-unrelated-group", "zero", "minus-one",
                                   "2**40", "the-launcher", "other-user"])
def test_a_stall_listed_with_a_pid_the_launcher_did_not_start_signals_nothing(
    processes, signals, other_user, claim):
  trainer, unrelated = processes
  pid = {"unrelated": unrelated.pid, "minus-unrelated-group": -unrelated.pid, "zero": 0,
         "minus-one": -1, "2**40": 2**40, "the-launcher": os.getpid(),
         "other-user": other_user}[claim]
  if pid is None:
    pytest.skip("no process of another user here")
  dog = Listed(_stalled(pid))
  assert dog.check({0: trainer}, 0) is None
  assert dog.check({0: trainer}, 0) is None  # and said once
  assert dog.said == [
      f"host 0 lists rank 0 stalled with pid {pid}, which is not in the process group of "
      f"the trainer this launcher started for it ({trainer.pid}); signalling nothing"]
  assert trainer.poll() is None and unrelated.poll() is None
  # Asked to kill it all the same (sidecar slurm's watch_one): nothing is signalled.
  stall = watchdog.Stall(0, 0, pid, 30.0, 10.0, 0)
  assert not dog.kill(stall, trainer.pid)
  assert trainer.poll() is None and unrelated.poll() is None
  assert signals == []


def test_the_trainers_own_stall_is_killed_after_one_more_look(processes, signals):
  trainer, unrelated = processes
  dog = Listed(_stalled(trainer.pid))
  found = dog.check({0: trainer}, 0)
  assert found is not None and found.pid == trainer.pid
  assert trainer.wait(timeout=10) == -9 and unrelated.poll() is None
  assert signals[-1] == (-trainer.pid, 9)  # its own group, and no other
  assert "then it is killed if it is still stalled" in dog.said[0]


def test_a_trainer_that_stepped_during_its_stacks_is_spared(processes, signals):
  trainer, _ = processes
  moved = pb.TrainerStatus(pid=trainer.pid, rank=0, restart=0, steps=6, since_step_s=0.4,
                           stall_timeout_s=10.0, stalled=False)
  dog = Listed(_stalled(trainer.pid), again=moved)
  assert dog.check({0: trainer}, 0) is None
  assert trainer.poll() is None
  assert dog.said[-1] == ("host 0 rank 0 stepped while its stacks were written (its last "
                          "step 0.4 s ago); not killing it")
  assert all(sig != 9 for _, sig in signals)


def _own_pid_namespace() -> str | None:
  """Why this machine cannot run a PID namespace whose pid counter the test sets (None:
  it can): ``unshare --pid`` as root, or as a user namespace's root (CI's runners may
  forbid both)."""
  for flags in (["--pid"], ["--user", "--map-root-user", "--pid"]):
    try:
      done = subprocess.run(["unshare", *flags, "--fork", "--mount-proc", "sh", "-c",
                             "echo 99 > /proc/sys/kernel/ns_last_pid"], capture_output=True,
                            timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
      return f"no unshare here ({e})"
    if done.returncode == 0:
      return None if flags == ["--pid"] else "user"
  return f"unshare --pid refused here: {done.stderr.decode(errors='replace').strip()}"


def test_a_new_life_with_the_pid_of_a_gone_sessions_process_is_never_killed(tmp_path):
  """Issue 76, attack 5: 96 sessions claim rank 0 of the next start from processes that
  then exit, the pid counter is turned back onto their pids, and the next life gets one of
  them; it attaches 4 s later (its sidecar lists those sessions stalled meanwhile). A
  session's pid is gone with its process, and the launcher signals only its own trainers'
  groups: the life runs to its end (on main: SIGKILLed "stalled", exit 124)."""
  why = _own_pid_namespace()
  if why not in (None, "user"):
    pytest.skip(why)
  user = ["--user", "--map-root-user"] if why == "user" else []
  done = subprocess.run(
      ["unshare", *user, "--pid", "--fork", "--mount-proc", sys.executable, "-m",
       "tests.support.pid_reuse", "attack", str(tmp_path)], cwd=ROOT, capture_output=True,
      text=True, timeout=180)
  log = (tmp_path / "launch.log").read_text()
  assert done.returncode == 0, done.stdout + done.stderr + log
  got = results(done.stdout)[0]
  assert got["reused"], got  # the scenario: the next life has a pid of a gone session's
  assert got["code"] == 0 and got["done"], log
  assert "stalled" not in log.replace("lists rank 0 stalled", ""), log


BUSY = "while True: pass"
IDLE = "import time; time.sleep(60)"
ARMED = ("import faulthandler, signal, subprocess, sys, time\n"
         "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
         "print('ready', flush=True)\n{body}")


def _trainer(body: str) -> subprocess.Popen:
  """A trainer as the launcher starts one (leading its own group), armed for its stacks, with
  a child in its group that is not."""
  p = subprocess.Popen([sys.executable, "-c", ARMED.format(body=body)],
                       stdout=subprocess.PIPE, start_new_session=True)
  assert p.stdout.readline() == b"ready\n"
  return p


@pytest.mark.parametrize("body, killed", [(BUSY, False), (IDLE, True)], ids=["busy", "idle"])
def test_busy_is_slow_and_idle_is_hung_and_the_stacks_go_to_who_catches_them(
    signals, body, killed):
  """Issue 77 at the watchdog: a stalled trainer whose group burns CPU is slow (said once,
  its stacks asked, left alone); an idle one is hung and its group killed. The stacks
  signal goes to the group's members the kernel says catch it, never a listed pid."""
  trainer = _trainer(body)
  try:
    dog = Listed(_stalled(trainer.pid))
    dog._groups = lambda: {0: trainer.pid}
    for _ in range(3):  # readings of its CPU over more than half a second
      dog._sampled = -1.0
      dog.sample()
      time.sleep(0.3)
    found = dog.check({0: trainer}, 0)
    assert (found is not None) == killed
    stacks = [pid for pid, sig in signals if sig == signal.SIGUSR2]
    assert stacks == [trainer.pid]  # its child, in its group, does not catch it
    if killed:
      assert trainer.wait(timeout=10) == -9 and "and idle" in dog.said[0]
      assert signals[-1] == (-trainer.pid, signal.SIGKILL)
    else:
      assert trainer.poll() is None and "is slow" in dog.said[0] and "ctl.phase" in dog.said[0]
      assert dog.check({0: trainer}, 0) is None and len(dog.said) == 1  # said once
  finally:
    trainer.kill()
    trainer.wait()
    trainers.signal_group(trainer.pid, signal.SIGKILL)
