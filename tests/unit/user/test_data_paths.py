"""A pipeline's paths beneath its tenant's data roots (``ctx.data_path``): real files and
symlinks in tmp_path, each escape tried through the kernel's openat2 and through the walk
that stands in where there is none; swaps raced by a thread."""

import errno
import os
import pickle
import sys
import threading
import time

import pytest

import sidecar
from sidecar._src.core import beneath
from sidecar._src.user.data_roots import ANYWHERE, DataRoots

pytestmark = pytest.mark.unit

SECRET = b"alice's secret bytes"
MINE = b"bob's own bytes"


@pytest.fixture(params=["openat2", "walk"])
def how(request):
  """Each test once with the kernel's openat2 (where it has one) and once with the walk."""
  if request.param == "walk":
    beneath._libc[:] = [None]  # as a kernel without openat2
  yield request.param
  beneath._libc[:] = []


@pytest.fixture
def tree(tmp_path):
  """alice/secret; bob's root with a file, a subdirectory, and symlinks in and out."""
  (tmp_path / "alice").mkdir()
  (tmp_path / "alice" / "secret").write_bytes(SECRET)
  bob = tmp_path / "bob"
  (bob / "sub").mkdir(parents=True)
  (bob / "sub" / "f").write_bytes(MINE)
  (bob / "g.bin").write_bytes(MINE)
  (bob / ".hidden.bin").write_bytes(MINE)
  os.symlink(tmp_path / "alice" / "secret", bob / "abs_out")
  os.symlink("../alice/secret", bob / "rel_out")
  os.symlink("sub/f", bob / "rel_in")
  os.symlink(bob / "sub" / "f", bob / "abs_in")
  os.symlink(tmp_path / "alice", bob / "dir_out")
  return tmp_path


def _ctx(tmp_path, roots=("bob",)):
  return sidecar.PipelineContext(
      shard_index=0, shard_count=1,
      data_roots=DataRoots(roots=tuple(str(tmp_path / r) for r in roots), tenant="bob",
                           where="pool.yaml:3"))


@pytest.mark.parametrize("name", ["sub/f", "rel_in", "abs_in", "sub/../sub/f", "./sub//f"])
def test_paths_beneath_the_root_read_even_through_symlinks_that_stay_there(tree, how, name):
  with _ctx(tree).data_path(f"{tree}/bob/{name}").open() as f:
    assert f.read() == MINE and f.name == f"{tree}/bob/{name}"


@pytest.mark.parametrize("name", ["abs_out", "rel_out", "../alice/secret", "dir_out/secret",
                                  "sub/../../alice/secret"])
def test_a_path_that_leads_out_is_refused_naming_the_root(tree, how, name):
  with pytest.raises(sidecar.PermissionDeniedError,
                     match=rf"'{tree}/bob/{name}' leads out of its data root '{tree}/bob' \(a "
                     r"symlink or '..' on its way goes outside it\); tenant 'bob'.s data roots "
                     rf"\({tree}/bob; pool.yaml:3\)"):
    _ctx(tree).data_path(f"{tree}/bob/{name}").open()


class _Opens:
  """The audit events of filesystem calls this process makes while it is on."""
  on = False
  seen: list[str] = []


def _audit(event, args):
  if _Opens.on and (event == "open" or event.startswith("os.")):
    _Opens.seen.append(event)


sys.addaudithook(_audit)  # one for the module: a hook cannot be removed; _Opens.on gates it


def test_outside_the_roots_is_refused_before_any_filesystem_call_alike_whether_there(tree):
  ctx = _ctx(tree)
  _Opens.seen.clear()
  _Opens.on = True
  try:
    with pytest.raises(sidecar.PermissionDeniedError) as there:
      ctx.data_path(f"{tree}/alice/secret")
    with pytest.raises(sidecar.PermissionDeniedError) as missing:
      ctx.data_path(f"{tree}/alice/nothing")
    with pytest.raises(sidecar.PermissionDeniedError):
      ctx.data_path(f"{tree}/bo")  # a prefix of a root's name is no root
  finally:
    _Opens.on = False
  assert _Opens.seen == []
  assert str(there.value).replace("secret", "X") == str(missing.value).replace("nothing", "X")
  assert (f"is not under tenant 'bob''s data roots ({tree}/bob; pool.yaml:3); a pool tenant's "
          "pipelines read files only beneath its data roots") in str(there.value)


def test_a_tenant_with_no_roots_reads_nothing(tree):
  with pytest.raises(sidecar.PermissionDeniedError,
                     match=r"tenant 'bob'.s data roots \(none; pool.yaml:3\) are none, so its "
                     r"pipelines may read no file; .* give it data_roots"):
    _ctx(tree, roots=()).data_path(f"{tree}/bob/g.bin")


def test_missing_beneath_the_root_is_not_found_naming_the_roots(tree, how):
  for name in ("nothing", "sub/nothing", "g.bin/x"):
    with pytest.raises(sidecar.NotFoundError,
                       match=rf"no file or directory at '{tree}/bob/{name}' under tenant "
                       r"'bob'.s data roots") as e:
      _ctx(tree).data_path(f"{tree}/bob/{name}").open()
    assert isinstance(e.value, FileNotFoundError)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "", "a//b", "a\0b"])
def test_a_name_from_a_manifest_is_relative_with_no_dotdot(tree, name):
  with pytest.raises(sidecar.InvalidArgumentError, match=r"is no name inside .*no '..' or empty"):
    _ctx(tree).data_path(f"{tree}/bob") / name


def test_a_fifo_or_a_directory_is_refused_without_blocking(tree, how):
  os.mkfifo(tree / "bob" / "fifo")  # an open of it for reading would wait for a writer
  with pytest.raises(sidecar.InvalidArgumentError, match=r"'.*/bob/fifo' is no regular file"):
    _ctx(tree).data_path(f"{tree}/bob/fifo").open()
  with pytest.raises(sidecar.InvalidArgumentError, match=r"'.*/bob/sub' is a directory"):
    _ctx(tree).data_path(f"{tree}/bob/sub").open()


def test_a_glob_matches_files_beneath_the_root_only(tree, how):
  found = _ctx(tree).data_path(f"{tree}/bob/*").expand()
  # Links that stay beneath it match (as the files they reach); those that lead out, the
  # hidden file and the directories do not.
  assert [os.path.basename(str(p)) for p in found] == ["abs_in", "g.bin", "rel_in"]
  assert [str(p) for p in _ctx(tree).data_path(f"{tree}/bob/*/f").expand()] == [
      f"{tree}/bob/sub/f"]
  assert len(_ctx(tree).data_path(f"{tree}/bob/.h*").expand()) == 1
  with pytest.raises(sidecar.NotFoundError,
                     match=rf"no Parquet file at '{tree}/bob/\*.parquet' under tenant 'bob'"):
    _ctx(tree).data_path(f"{tree}/bob/*.parquet").expand(what="Parquet file")
  with pytest.raises(sidecar.PermissionDeniedError, match="is not under"):
    _ctx(tree).data_path(f"{tree}/*/secret")


def test_a_library_reaches_the_very_file_opened_whatever_is_swapped_after(tree, how):
  f = _ctx(tree).data_path(f"{tree}/bob/g.bin").open()
  os.rename(tree / "bob" / "g.bin", tree / "bob" / "old")
  os.symlink(tree / "alice" / "secret", tree / "bob" / "g.bin")
  assert f.library_path == f"/proc/{os.getpid()}/fd/{f.fileno()}"
  with open(f.library_path, "rb") as again:  # as pyarrow or ArrayRecord would
    assert again.read() == MINE
  with pytest.raises(TypeError, match="cannot cross to another process"):
    pickle.dumps(f)
  f.close()
  with pytest.raises(ValueError, match="is closed"):
    _ = f.library_path


def _flip(path, target, stop):
  """Flips ``path`` between a file of bob's bytes and a symlink to ``target`` until
  ``stop``, each by a rename (never missing)."""
  while not stop.is_set():
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
      f.write(MINE)
    os.rename(tmp, path)
    time.sleep(0.0005)  # each state lasts: the opens meet both
    os.symlink(target, tmp)
    os.rename(tmp, path)
    time.sleep(0.0005)


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_swap_raced_against_the_opens_never_reads_out(tree, how, what):
  bob = tree / "bob"
  if what == "file":
    flipped, target, name = bob / "race", tree / "alice" / "secret", "race"
    flipped.write_bytes(MINE)
  else:  # a directory on the way, flipped to a symlink to alice's directory
    (bob / "d").mkdir()
    (bob / "d" / "secret").write_bytes(MINE)
    flipped, target, name = bob / "race", tree / "alice", "race/secret"
    os.symlink("d", bob / "race")
  stop = threading.Event()
  thread = threading.Thread(target=_flip if what == "file" else _flip_dir,
                            args=(flipped, target, stop))
  thread.start()
  read, refused = 0, 0
  try:
    for _ in range(1500):
      try:
        with _ctx(tree).data_path(f"{bob}/{name}").open() as f:
          assert f.read() == MINE
          read += 1
      except sidecar.PermissionDeniedError:
        refused += 1
  finally:
    stop.set()
    thread.join()
  assert read and refused, (read, refused)  # both states met; the secret never read


def _flip_dir(path, target, stop):
  """Flips the symlink ``path`` between ``d`` (bob's directory) and ``target``."""
  while not stop.is_set():
    for to in (target, "d"):
      os.symlink(to, f"{path}.tmp")
      os.rename(f"{path}.tmp", path)
      time.sleep(0.0005)


def test_a_view_is_a_private_tree_of_the_files_opened_beneath_the_root(tree, how):
  data = tree / "bob" / "ds"
  (data / "1.0.0").mkdir(parents=True)
  (data / "1.0.0" / "info.json").write_bytes(b"{}")
  (data / "1.0.0" / "shard-0").write_bytes(MINE)
  os.symlink("1.0.0", data / "latest")  # a link that stays beneath: its files seen twice
  os.mkfifo(data / "fifo")  # left out
  view = _ctx(tree).data_path(str(data)).view()
  path = view.path
  assert os.path.basename(path) == "ds" and os.listdir(os.path.dirname(path)) == ["ds"]
  assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
  assert sorted(os.listdir(path)) == ["1.0.0", "latest"]
  # Swapped after the view was made: the view still reads what it opened.
  os.rename(data / "1.0.0" / "shard-0", data / "old")
  os.symlink(tree / "alice" / "secret", data / "1.0.0" / "shard-0")
  with open(os.path.join(path, "1.0.0", "shard-0"), "rb") as f:
    assert f.read() == MINE
  with pytest.raises(TypeError, match="cannot cross to another process"):
    pickle.dumps(view)
  fds = [int(os.readlink(os.path.join(path, v, "shard-0")).rsplit("/", 1)[1])
         for v in ("1.0.0", "latest")]
  view.close()
  assert not os.path.exists(os.path.dirname(path))
  for fd in fds:  # its descriptors closed with it (or taken since by another open)
    with pytest.raises(OSError) as e:
      os.fstat(fd)
    assert e.value.errno == errno.EBADF


def _views() -> set[str]:
  import tempfile
  return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("sidecar-view-")}


def test_a_view_refuses_an_entry_that_leads_out(tree, how):
  os.symlink(tree / "alice" / "secret", tree / "bob" / "sub" / "out")
  before = _views()
  with pytest.raises(sidecar.PermissionDeniedError,
                     match=rf"'{tree}/bob/sub/out' leads out of its data root"):
    _ctx(tree).data_path(f"{tree}/bob/sub").view()
  assert _views() <= before  # its half-made tree removed


def test_outside_a_pool_nothing_changes(tree):
  ctx = sidecar.PipelineContext(shard_index=0, shard_count=1)
  assert ctx.data_roots is ANYWHERE
  with ctx.data_path(f"{tree}/bob/abs_out").open() as f:  # symlinks followed anywhere
    assert f.read() == SECRET and f.library_path == f"{tree}/bob/abs_out"
    assert pickle.loads(pickle.dumps(f)).read() == SECRET
  assert [str(p) for p in ctx.data_path(f"{tree}/bob/*.bin").expand()] == [f"{tree}/bob/g.bin"]
  assert ctx.data_path(f"{tree}/bob").view().path == f"{tree}/bob"
  with pytest.raises(sidecar.NotFoundError, match="no file at"):
    ctx.data_path(f"{tree}/nothing").open()


def test_data_roots_cross_to_a_feed_worker_as_a_dict():
  roots = DataRoots(roots=("/data/bob", "/ckpt/bob"), tenant="bob", where="pool.yaml:3")
  assert DataRoots.from_dict(roots.to_dict()) == roots
  assert DataRoots.from_dict(ANYWHERE.to_dict()) == ANYWHERE
  with pytest.raises(ValueError, match="absolute"):
    DataRoots(roots=("data",))


# ---- round 7 (issue 70): walks bounded, open files counted -------------------------------

def test_a_glob_through_symlink_loops_lists_each_directory_once(tree, how):
  """Eight links to '.' and a pattern nine levels deep: 8**8 ways to one directory, each
  listed once (by device and inode); before, the walk never ended (issue 70, item 2)."""
  bob = tree / "bob"
  for i in range(8):
    os.symlink(".", bob / f"l{i}")
  (bob / "t.parquet").write_bytes(MINE)
  for depth in (8, 1):  # every '*/' reaches bob's root, listed already: no match there
    with pytest.raises(sidecar.NotFoundError, match="no file at"):
      _ctx(tree).data_path(f"{bob}/{'*/' * depth}*.parquet").expand()
  assert [str(p) for p in _ctx(tree).data_path(f"{bob}/*.parquet").expand()] == [
      f"{bob}/t.parquet"]


def test_a_glob_past_its_caps_is_refused_naming_them(tree, how, monkeypatch):
  from sidecar._src.user import data_paths
  bob = tree / "bob"
  for i in range(4):
    (bob / "many" / f"d{i}").mkdir(parents=True)
    (bob / "many" / f"d{i}" / "x.bin").write_bytes(MINE)
  monkeypatch.setattr(data_paths, "MAX_GLOB_DIRS", 3)
  with pytest.raises(sidecar.InvalidArgumentError, match="walks more than 3 directories"):
    _ctx(tree).data_path(f"{bob}/many/*/*.bin").expand()
  monkeypatch.setattr(data_paths, "MAX_GLOB_DIRS", 100)
  monkeypatch.setattr(data_paths, "MAX_GLOB_MATCHES", 5)
  with pytest.raises(sidecar.InvalidArgumentError, match="matches more than 5 entries"):
    _ctx(tree).data_path(f"{bob}/many/*/*.bin").expand()


def _limited(tmp_path, most):
  return sidecar.PipelineContext(
      shard_index=0, shard_count=1,
      data_roots=DataRoots(roots=(str(tmp_path / "bob"),), tenant="bob-files",
                           where="pool.yaml:3", open_files=most,
                           open_files_why=f"open_files={most}, pool.yaml:3"))


def test_open_files_count_against_the_tenant_until_closed(tree, how):
  """Files held open (a reader's, a view's) count against the tenant's open_files; past
  it, its next is refused naming the quota, and closing gives them back (item 3)."""
  from sidecar._src.user.data_roots import OPEN_FILES
  ctx = _limited(tree, 3)
  data = tree / "bob" / "ds"
  data.mkdir()
  for i in range(2):
    (data / f"shard-{i}").write_bytes(MINE)
  view = ctx.data_path(str(data)).view()
  held = ctx.data_path(f"{tree}/bob/g.bin").open()
  assert OPEN_FILES.held("bob-files") == 3
  with pytest.raises(sidecar.ResourceExhaustedError,
                     match=r"tenant 'bob-files''s feeds hold 3 open files; opening .* would "
                           r"pass its quota \(open_files=3, pool.yaml:3\); close feeds"):
    ctx.data_path(f"{tree}/bob/sub/f").open()
  with pytest.raises(sidecar.ResourceExhaustedError,
                     match=r"hold 3 open files; one more file for the view of .* \(which "
                           r"holds 0 so far\) would pass"):
    ctx.data_path(str(data)).view()
  assert OPEN_FILES.held("bob-files") == 3  # the refused ones hold nothing
  held.close()
  held.close()  # idempotent: given back once
  assert OPEN_FILES.held("bob-files") == 2
  del view  # its last reference
  assert OPEN_FILES.held("bob-files") == 0
  with ctx.data_path(f"{tree}/bob/sub/f").open() as f:
    assert f.read() == MINE


def test_an_open_past_the_quota_waits_for_files_given_back(tree, how):
  """A feed closed by its client gives its files back when its pipeline ends on the
  sidecar, which may come after the client's next feed opens: that open waits (up to
  GIVE_BACK_S) instead of being refused (CI saw `close a feed, open another` refused)."""
  from sidecar._src.user.data_roots import OPEN_FILES
  ctx = _limited(tree, 1)
  (tree / "bob" / "sub" / "g").write_bytes(MINE)
  held = ctx.data_path(f"{tree}/bob/sub/f").open()
  closing = threading.Timer(0.3, held.close)  # the ending pipeline, on its own thread
  closing.start()
  try:
    with ctx.data_path(f"{tree}/bob/sub/g").open() as f:
      assert f.read() == MINE and held.closed  # it waited for the close, and got its file
  finally:
    closing.join()
  assert OPEN_FILES.held("bob-files") == 0


def test_open_files_cross_to_a_feed_worker():
  roots = DataRoots(roots=("/data/bob",), tenant="bob", open_files=7,
                    open_files_why="open_files=7, pool.yaml:3")
  assert DataRoots.from_dict(roots.to_dict()) == roots


def test_a_glob_stops_when_its_caller_goes(tree, how):
  """A pool glob asks whether its caller (the feed's client) is still there at its first
  directory and every ``ALIVE_EVERY_DIRS`` after: once gone, it stops, typed (issue 70,
  item 2); before, it listed all its directories for nobody."""
  from sidecar._src.user import data_paths
  bob = tree / "bob"
  for i in range(200):
    (bob / "many" / f"d{i:03}").mkdir(parents=True)
    (bob / "many" / f"d{i:03}" / "x.bin").write_bytes(MINE)
  pattern = f"{bob}/many/*/*.bin"
  asked = []

  def alive():
    asked.append(1)
    return len(asked) < 3  # gone at its third question

  with data_paths.while_alive(alive), pytest.raises(
      sidecar.ClosedError, match=r"stopped after 129 directories: the feed's client is gone"):
    _ctx(tree).data_path(pattern).expand()
  assert len(asked) == 3  # at directories 1, 65 and 129 of 201
  with data_paths.while_alive(lambda: True):
    assert len(_ctx(tree).data_path(pattern).expand()) == 200
  assert len(_ctx(tree).data_path(pattern).expand()) == 200  # nobody asks outside a feed
