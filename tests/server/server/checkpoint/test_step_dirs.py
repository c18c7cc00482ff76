"""Tier 2: no step operation resolves a path twice (issue 76, attack 1), made to happen at
the racy moment, not raced: bob (a pool tenant) and alice on one in-process sidecar, a
symlink to alice's directory where bob's step or directory was. The race itself, with bob
as his own Unix user swapping his directory in a loop, is
tests/processes/server/test_swapped_step_dirs.py.

Before: a Delete resolved its step's path again after the service checked its directory,
and removed what that path led to; a commit renamed its step by path. Now each acts only
relative to a directory it opened once from its checkpoint root, no symlink followed.
"""

import os
import pathlib
import threading

import numpy as np
import pytest

import sidecar
from sidecar._src.ckptfmt.save_values import Begin
from sidecar._src.server.checkpoint import faults
from tests.conftest import eventually
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.server

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob]}
"""
W = np.arange(64, dtype=np.float32)


def _steps(run: pathlib.Path) -> list[str]:
  return sorted(p.name for p in run.iterdir() if p.name.isdigit())


def _saved(server, token: str, run: pathlib.Path, steps) -> None:
  with controller(server, token) as ctl, ctl.checkpointer(str(run)) as ck:
    for step in steps:
      assert ck.save(step, {"w": W + step}).durable.result(30) == step


def test_a_delete_of_a_step_that_is_a_symlink_to_alices_leaves_hers(make_server, tmp_path):
  """Bob's step 3 is a symlink to alice's step 3. His Delete of it resolved the step's
  path by itself (the service checked only his directory) and removed hers."""
  server = make_server(pool=write_pool(tmp_path, POOL))
  alice, bob = tmp_path / "alice" / "run", tmp_path / "bob" / "run"
  _saved(server, ALICE, alice, (3,))
  _saved(server, BOB, bob, (1,))
  (bob / "3").symlink_to(alice / "3")
  with controller(server, BOB) as ctl:
    with pytest.raises(sidecar.PermissionDeniedError,
                       match=r"bob/run/3' is a symlink; delete removes only a step directory a "
                             r"checkpoint wrote, and follows no symlink"):
      ctl.checkpoint_client().delete(0, str(bob), 3).result(10)
    ctl.checkpoint_client().delete(0, str(bob), 1).result(10)  # his own step goes
  assert _steps(alice) == ["3"] and _steps(bob) == ["3"] and (bob / "3").is_symlink()
  with controller(server, ALICE) as ctl, ctl.checkpointer(str(alice)) as ck:
    np.testing.assert_array_equal(ck.restore(3, target={"w": np.zeros_like(W)})["w"], W + 3)


def test_a_commit_whose_directory_became_a_symlink_renames_only_its_own_step(
    make_server, tmp_path, monkeypatch):
  """Bob's save of step 8 is held inside its commit, its files in place and its rename to
  come; then his directory is swapped for a symlink to alice's, where her save of step 8
  is in flight. His commit renamed by path: her uncommitted step became her step 8."""
  server = make_server(pool=write_pool(tmp_path, POOL))
  alice, bob = tmp_path / "alice" / "run", tmp_path / "bob" / "run"
  _saved(server, ALICE, alice, (1,))
  with controller(server, ALICE) as ctl:
    theirs = pathlib.Path(
        ctl.checkpoint_client().send(0, Begin(str(alice), 8, "orbax")).result(10))
  release = tmp_path / "release"
  monkeypatch.setenv(faults.FAULT_ENV, f"slowrename@8:{release}")
  with controller(server, BOB) as ctl, ctl.checkpointer(str(bob)) as ck:
    done = []
    save = threading.Thread(target=lambda: done.append(ck.save(8, {"w": W}).durable.result(60)))
    save.start()
    try:
      # Held: every file of its step in place, the rename to come.
      assert eventually(lambda: (bob / "8.orbax-checkpoint-tmp" / "commit_success.txt")
                        .exists(), timeout=30)
      os.rename(bob, bob.with_name("run.real"))
      bob.symlink_to(alice)
    finally:
      release.touch()
      save.join(60)
    bob.unlink()
    os.rename(bob.with_name("run.real"), bob)
  assert done == [8]  # committed, in his own directory
  assert _steps(bob) == ["8"]
  assert _steps(alice) == ["1"] and theirs.is_dir()  # hers is still in flight, uncommitted
