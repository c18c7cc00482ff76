"""A tenant process's temporary directory, counted as ``du`` counts it
(server/tenant_procs/tmp.py): files, links and directories, each at least 4 KiB, the walk
bounded; and what a sidecar that is gone left, removed by the next one's start.

Tier 1: real directories, no server.
"""

import fcntl
import os

import pytest

from sidecar._src.server.tenant_procs import tmp

pytestmark = pytest.mark.unit


def test_directories_and_links_count_not_only_files(tmp_path):
  assert tmp.measure(str(tmp_path), 1 << 30) == 0
  for i in range(10):
    (tmp_path / f"d{i}").mkdir()
    os.symlink("/proc/self/fd/0", tmp_path / f"d{i}" / "link")
  # Issue 76, attack 8: TFDS views are directories of links; only files were counted.
  assert tmp.measure(str(tmp_path), 1 << 30) >= 20 * tmp.MIN_ENTRY
  (tmp_path / "big").write_bytes(b"x" * (1 << 20))
  assert tmp.measure(str(tmp_path), 1 << 30) >= (1 << 20) + 20 * tmp.MIN_ENTRY


def test_a_sparse_file_counts_its_size(tmp_path):
  with open(tmp_path / "sparse", "wb") as f:
    f.truncate(64 << 20)
  assert tmp.measure(str(tmp_path), 1 << 30) >= 64 << 20


def test_the_walk_stops_past_its_bound_and_past_its_depth(tmp_path):
  for i in range(100):
    (tmp_path / f"f{i}").touch()
  assert tmp.measure(str(tmp_path), 10 * tmp.MIN_ENTRY) == 11 * tmp.MIN_ENTRY
  deep = tmp_path / "deep"
  path = deep
  for _ in range(tmp.MAX_DEPTH + 2):
    path = path / "d"
  path.mkdir(parents=True)
  assert tmp.measure(str(deep), 1 << 30) > 1 << 30  # past any bound


def test_no_link_is_followed(tmp_path):
  (tmp_path / "outside").mkdir()
  (tmp_path / "outside" / "big").write_bytes(b"x" * (4 << 20))
  (tmp_path / "mine").mkdir()
  os.symlink(tmp_path / "outside", tmp_path / "mine" / "link")
  assert tmp.measure(str(tmp_path / "mine"), 1 << 30) == tmp.MIN_ENTRY


def test_a_gone_sidecar_s_directories_go_at_the_next_start_a_live_one_s_stay(tmp_path):
  live = tmp.TmpBase(str(tmp_path))
  mine = live.make("alice", None, None)
  (tmp_path / f"{tmp.PREFIX}gone").mkdir()
  (tmp_path / f"{tmp.PREFIX}gone" / "bob-1").mkdir()
  (tmp_path / f"{tmp.PREFIX}gone" / "bob-1" / "view").mkdir()
  lock = tmp_path / f"{tmp.PREFIX}gone" / ".lock"
  lock.touch()
  with open(lock) as f:  # as if its sidecar still lived
    fcntl.flock(f, fcntl.LOCK_EX)
    tmp.TmpBase(str(tmp_path)).close()
    assert (tmp_path / f"{tmp.PREFIX}gone" / "bob-1").exists()
  with tmp.TmpBase(str(tmp_path)):  # now its lock is free: it is gone
    assert not (tmp_path / f"{tmp.PREFIX}gone").exists()
    assert os.path.isdir(mine)  # the live one's stays
  live.close()
  assert not os.path.exists(live.path)


def test_a_tenant_s_directory_is_its_own_and_private(tmp_path):
  with tmp.TmpBase(str(tmp_path)) as base:
    path = base.make("bob", 10002, 10002)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (10002, 10002, 0o700)
    assert os.stat(base.path).st_mode & 0o777 == 0o711
    (tmp_path / "x").mkdir()
    os.chown(tmp_path / "x", 10002, 10002)
    base.remove(path, 10002)
    assert not os.path.exists(path)
