"""Isolation, round 8, attack 1 (issue 76): bob, as his own Unix user, owns his checkpoint
directory ``bob/run`` and swaps it with a symlink to alice's directory in a loop
(``renameat2``'s exchange) while his own step operations on ``run`` race it, through the
wire. An in-process pool sidecar (root, as a pod's sidecar may be); bob's swaps in a child
process of another user.

Before: each operation checked a path and then acted on the path string, resolved again
by the kernel: his Deletes of ``run``'s steps removed all of alice's committed steps (0600
files in her 0700 root-owned directory) within a few seconds, his Aborts her save in flight.
Now each opens the step's directory once from its checkpoint root, no symlink followed at
any component, and checks and acts relative to that descriptor: a swap before the open is a
refusal, one after it changes nothing the descriptor reaches.
"""

import contextlib
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.save_values import Abort, Begin
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.processes

BOB_UID = 10002  # bob's Unix user (no passwd entry needed)
POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""
W = np.arange(256, dtype=np.float32)
STEPS = (1, 2, 3)
RACE_S = 2.0  # how long bob races (main lost alice's steps within 0.1-4 s)

# Bob's user: swaps ``run`` and ``run.link`` (a symlink to alice's directory) in one step,
# over and over, until killed; says so once it runs.
_SWAP = r"""
import ctypes, os, sys
bob, uid = sys.argv[1], int(sys.argv[2])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
libc = ctypes.CDLL(None, use_errno=True)
a, b = os.fsencode(os.path.join(bob, "run")), os.fsencode(os.path.join(bob, "run.link"))
print("swapping", flush=True)
while True:
  if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
    sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""


@pytest.fixture(scope="module")
def attacked():
  """A pool sidecar (in this process, as root); alice's steps 1-3 committed in her 0700
  root-owned directory, bob's in his own, which his user owns, beside his symlink to hers.
  All in a directory of /tmp every user may enter; removed after."""
  if os.geteuid() != 0:
    pytest.skip(f"a second Unix user needs root here (setuid to uid {BOB_UID}); this runs "
                f"as uid {os.geteuid()}; the descriptor walks themselves are in "
                "tests/unit/ckptfmt/test_dir_fd.py")
  from sidecar._src.core import options as options_lib
  from sidecar._src.server.server import Server
  base = pathlib.Path(f"/tmp/sidecar-swap-{secrets.token_hex(6)}")
  base.mkdir(0o755)
  server = Server(options_lib.ServerOptions(
      port=0, health_port=0, listen="127.0.0.1", shm_size=8 << 20,
      socket_path=str(base / "s.sock"), checkpoint_roots=(str(base),),
      pool=write_pool(base, POOL))).start()
  try:
    alice, bob = base / "alice", base / "bob"
    os.chmod(alice, 0o700)  # root's alone: the kernel keeps bob's user out
    for token, where in ((ALICE, alice / "run"), (BOB, bob / "run")):
      with controller(server, token) as ctl, ctl.checkpointer(str(where)) as ck:
        for step in STEPS:
          assert ck.save(step, {"w": W + step}).durable.result(30) == step
    for path in (bob, *(bob / "run").rglob("*"), bob / "run"):
      os.chown(path, BOB_UID, BOB_UID, follow_symlinks=False)
    os.symlink(alice / "run", bob / "run.link")
    os.chown(bob / "run.link", BOB_UID, BOB_UID, follow_symlinks=False)
    for tenant in ("alice", "bob"):  # each started at its first read from storage: here, so
      server.tenant_procs.process(tenant)  # their threads are the module's, not a test's
    yield server, alice / "run", bob / "run"
  finally:
    server.stop(grace=0)
    shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def swapping(bob: pathlib.Path):
  """Bob's child process swapping ``bob/run`` with ``bob/run.link`` while the block runs."""
  swap = subprocess.Popen([sys.executable, "-c", _SWAP, str(bob), str(BOB_UID)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert swap.stdout.readline().strip() == "swapping", swap.stderr.read()
    yield swap
  finally:
    swap.kill()
    swap.wait(10)
  # It swapped all along (an odd number of swaps leaves run a symlink: put it back).
  if (bob / "run").is_symlink():
    os.rename(bob / "run", bob / "run.tmp")
    os.rename(bob / "run.link", bob / "run")
    os.rename(bob / "run.tmp", bob / "run.link")


def _steps(run: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in run.iterdir() if p.name.isdigit())


def _alices_steps_whole(server, alice_run: pathlib.Path) -> None:
  assert _steps(alice_run) == list(STEPS), sorted(p.name for p in alice_run.iterdir())
  with controller(server, ALICE) as ctl, ctl.checkpointer(str(alice_run)) as ck:
    for step in STEPS:
      np.testing.assert_array_equal(ck.restore(step, target={"w": np.zeros_like(W)})["w"],
                                    W + step)


@pytest.mark.timeout(120)
def test_bobs_deletes_through_a_swapped_symlink_never_remove_alices_steps(attacked):
  server, alice_run, bob_run = attacked
  outcomes: dict[str, int] = {}
  with controller(server, BOB) as ctl:
    client = ctl.checkpoint_client()
    with swapping(bob_run.parent):
      deadline = time.monotonic() + RACE_S
      while time.monotonic() < deadline and _steps(alice_run) == list(STEPS):
        for step in STEPS:
          try:
            client.delete(0, str(bob_run), step).result(10)
            outcomes["answered"] = outcomes.get("answered", 0) + 1
          except sidecar.SidecarError as e:
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
  print("deletes:", outcomes, f"{time.monotonic() - deadline + RACE_S:.2f} s")
  _alices_steps_whole(server, alice_run)
  assert outcomes.get("answered"), outcomes  # the race ran: some Deletes went through


@pytest.mark.timeout(120)
def test_bobs_aborts_through_a_swapped_symlink_never_remove_alices_save_in_flight(attacked):
  server, alice_run, bob_run = attacked
  with controller(server, ALICE) as alice:
    tmp = alice.checkpoint_client().send(0, Begin(str(alice_run), 7, "orbax")).result(10)
    outcomes: dict[str, int] = {}
    with controller(server, BOB) as ctl:
      client = ctl.checkpoint_client()
      with swapping(bob_run.parent):
        deadline = time.monotonic() + RACE_S
        while time.monotonic() < deadline and pathlib.Path(tmp).is_dir():
          try:
            client.send(0, Abort(str(bob_run / "7.orbax-checkpoint-tmp"), str(bob_run / "7")),
                        timeout=10).result(10)
            outcomes["answered"] = outcomes.get("answered", 0) + 1
          except sidecar.SidecarError as e:
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
    print("aborts:", outcomes, f"{time.monotonic() - deadline + RACE_S:.2f} s")
    assert pathlib.Path(tmp).is_dir(), outcomes  # alice's save in flight keeps its directory
    assert outcomes.get("answered"), outcomes
  _alices_steps_whole(server, alice_run)


@pytest.mark.timeout(120)
def test_bobs_opens_through_a_swapped_symlink_never_sweep_nor_write_in_alices_directory(
    attacked):
  server, alice_run, bob_run = attacked
  leftover = alice_run / "9.orbax-checkpoint-tmp"  # her save that crashed, hers to sweep
  leftover.mkdir()
  try:
    before = _tree(alice_run)
    outcomes: dict[str, int] = {}
    with controller(server, BOB) as ctl:
      client = ctl.checkpoint_client()
      with swapping(bob_run.parent):
        deadline = time.monotonic() + RACE_S
        while time.monotonic() < deadline and _tree(alice_run) == before:
          try:
            client.open(0, str(bob_run), ram_steps=1, ram_budget=None, sweep=True,
                        job="bobs-job").result(10)
            outcomes["answered"] = outcomes.get("answered", 0) + 1
          except sidecar.SidecarError as e:
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
    print("opens:", outcomes, f"{time.monotonic() - deadline + RACE_S:.2f} s")
    assert _tree(alice_run) == before, outcomes  # no sweep, no probe, no job's lock of his
    assert outcomes.get("answered"), outcomes
  finally:
    shutil.rmtree(leftover, ignore_errors=True)
  _alices_steps_whole(server, alice_run)


def _tree(path: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(path)) for p in path.rglob("*"))
