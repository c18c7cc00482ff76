"""What a checkpoint call may name: paths under the sidecar's roots, resolved first.

Real directories and symlinks in tmp_path; no server.
"""

import os

import numpy as np
import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.core import errors
from sidecar._src.server.checkpoint import roots as roots_lib

pytestmark = pytest.mark.unit


@pytest.fixture
def root(tmp_path):
  (tmp_path / "ck" / "run1").mkdir(parents=True)
  (tmp_path / "ck-sibling").mkdir()
  (tmp_path / "outside").mkdir()
  return tmp_path / "ck"


@pytest.mark.parametrize("name", ["ck", "ck/run1", "ck/run1/5.orbax-checkpoint-tmp/default",
                                  "ck/run1/../run2", "ck/./run1//", "ck-link/run1"],
                         ids=["root", "child", "not-yet-there", "dotdot-inside", "dots",
                              "link-into-root"])
def test_paths_under_a_root_resolve(root, tmp_path, name):
  (tmp_path / "ck-link").symlink_to(root)
  resolved = roots_lib.Roots(0, (str(root),)).resolve(str(tmp_path / name), "directory")
  assert resolved == os.path.realpath(tmp_path / name)
  assert resolved.startswith(os.path.realpath(root))


@pytest.mark.parametrize("name", ["ck/../outside", "ck/run1/../../outside", "ck-sibling",
                                  "ck/escape", "ck/escape/deeper", "."],
                         ids=["dotdot", "dotdot-twice", "prefix-sibling", "symlink-out",
                              "through-symlink-out", "parent"])
def test_paths_that_leave_the_root_are_refused(root, tmp_path, name):
  """``..`` and symlinks are resolved before the check; ``ck-sibling`` shares the
  root's name as a prefix but is not under it."""
  (root / "escape").symlink_to(tmp_path / "outside")
  path = str(tmp_path / name)
  resolved = os.path.realpath(path)
  with pytest.raises(errors.PermissionDeniedError) as raised:
    roots_lib.Roots(3, (str(root),)).resolve(path, "directory")
  assert str(raised.value) == (
      f"directory {path!r} (resolved: {resolved!r}) is not under a checkpoint root of sidecar "
      f"host 3 ({os.path.realpath(root)}); checkpoint there, or start the sidecar with "
      "--checkpoint-root naming its directory")


def test_a_root_given_through_a_symlink_holds_what_its_target_holds(root, tmp_path):
  (tmp_path / "link").symlink_to(root)
  roots = roots_lib.Roots(0, (str(tmp_path / "link"), str(tmp_path / "outside")))
  assert roots.resolve(str(root / "run1"), "item") == os.path.realpath(root / "run1")
  assert roots.root_of(os.path.realpath(tmp_path / "outside" / "x")) == os.path.realpath(
      tmp_path / "outside")
  assert roots.root_of(os.path.realpath(tmp_path / "ck-sibling")) is None


def test_the_filesystem_root_holds_every_path(tmp_path):
  assert roots_lib.Roots(0, ("/",)).resolve(str(tmp_path / "a"), "directory") == os.path.realpath(
      tmp_path / "a")


def test_a_sidecar_without_roots_refuses_every_path_and_says_how_to_give_one(tmp_path):
  with pytest.raises(errors.PermissionDeniedError,
                     match=r"^sidecar host 1 has no checkpoint root, so it refuses checkpoint "
                           r"calls \(final_dir '.*/x'\); start it with --checkpoint-root DIR "
                           r"\(repeatable, or SIDECAR_CHECKPOINT_ROOTS\) naming the directory"):
    roots_lib.Roots(1).resolve(str(tmp_path / "x"), "final_dir")


@pytest.mark.parametrize("bad", [None, 5, b"/tmp", "", "/tmp/a\0b"],
                         ids=["none", "int", "bytes", "empty", "nul"])
def test_a_path_that_is_not_a_path_string_is_invalid(root, bad):
  with pytest.raises(errors.InvalidArgumentError, match=r"^item must be a directory path, got "):
    roots_lib.Roots(0, (str(root),)).resolve(bad, "item")


def test_long_paths_are_cut_in_the_message(root):
  with pytest.raises(errors.PermissionDeniedError) as raised:
    roots_lib.Roots(0, (str(root),)).resolve("/" + "a" * 10_000, "directory")
  assert len(str(raised.value)) < 700


@pytest.mark.parametrize(("value", "expected"), [(3, 3), (np.int64(7), 7), (-1, -1)],
                         ids=["int", "numpy", "negative"])
def test_as_int_takes_ints(value, expected):
  assert roots_lib.as_int(value, "step") == expected and type(roots_lib.as_int(value, "s")) is int


@pytest.mark.parametrize("bad", [True, 3.0, "3", None], ids=["bool", "float", "str", "none"])
def test_as_int_names_the_value(bad):
  with pytest.raises(errors.InvalidArgumentError, match=rf"^step must be an int, got {bad!r}"):
    roots_lib.as_int(bad, "step")


class _Toy(OrbaxFormat):
  """A new format as the registry would hold it: its own scratch suffix and marker."""
  name, tmp_suffix, markers = "toy", ".toy-checkpoint-tmp", ("TOY_COMMITTED",)


def test_the_owners_walk_asks_the_registry_what_a_formats_directories_are(tmp_path):
  # roots.py names no format: a new format's scratch and committed steps are known to it
  # through the registry alone (ARCHITECTURE.md, "Where a new format goes").
  (tmp_path / "ck" / "5.toy-checkpoint-tmp" / "x").mkdir(parents=True)
  (tmp_path / "ck" / "7" / "y").mkdir(parents=True)
  (tmp_path / "ck" / "7" / "TOY_COMMITTED").write_text("")
  for inside in ("5.toy-checkpoint-tmp/x", "7/y"):
    (tmp_path / "ck" / inside / roots_lib.OWNER_FILE).write_text("bob\n")
  ck = str(tmp_path / "ck")
  found = roots_lib.foreign_owner(ck, str(tmp_path), "alice")
  assert found is not None and found[1] == "bob"  # the default formats enter both
  toy = formats_lib.DEFAULT.replacing(_Toy())
  assert roots_lib.foreign_owner(ck, str(tmp_path), "alice", toy) is None
  assert ".toy-checkpoint-tmp" in toy.scratch_suffixes()
  assert roots_lib.has_markers(tmp_path / "ck" / "7", toy)
  assert not roots_lib.has_markers(tmp_path / "ck" / "7")


def test_a_claim_is_never_seen_half_written(tmp_path, monkeypatch):
  # Two sidecars on one storage open the same directory at once: while one writes the
  # marker, the other reads it. It read '' then, and refused the marker's own tenant.
  seen = []
  write = os.write
  def watched(fd, data):
    seen.append(roots_lib.owner_of(str(tmp_path)))  # what a racing reader finds now
    return write(fd, data)
  monkeypatch.setattr(roots_lib.os, "write", watched)
  assert roots_lib.claim(str(tmp_path), "alice") == "alice"
  assert seen == [None]  # absent while written, then whole
  assert roots_lib.owner_of(str(tmp_path)) == "alice"
  assert roots_lib.claim(str(tmp_path), "bob") == "alice"
  assert sorted(os.listdir(tmp_path)) == [roots_lib.OWNER_FILE]  # nothing staged is left


def test_the_owners_walk_takes_an_entry_replaced_meanwhile_for_no_owner(tmp_path, monkeypatch):
  # The walk lists ck/5 as a directory; before it reads the owner file inside, ck/5 is
  # removed and a file takes its name. ENOTDIR read as an unreadable owner file, someone
  # else's: the open was refused over a directory that no longer was one.
  (tmp_path / "ck" / "5").mkdir(parents=True)
  marker = os.path.join(tmp_path, "ck", "5", roots_lib.OWNER_FILE)
  real, pending = os.open, [tmp_path / "ck" / "5"]

  def replaced_first(path, *args, **kwargs):
    if pending and path == marker:
      gone = pending.pop()
      gone.rmdir()
      gone.write_text("not a directory now")
    return real(path, *args, **kwargs)
  monkeypatch.setattr(roots_lib.os, "open", replaced_first)
  assert roots_lib.foreign_owner(str(tmp_path / "ck"), str(tmp_path), "alice") is None
  assert not pending  # replaced at the racy moment


# Issue 69 item 5: a Stage resolves its directory, the step's tmp directory and its final
# one, all in one directory; inside one call (``resolved_once``) each is resolved once, and
# one in a directory resolved already by one lstat of its last part.
_IN_ONE_CALL = ["ck/run1", "ck/run1/5.orbax-checkpoint-tmp",
                "ck/run1/5.orbax-checkpoint-tmp/default", "ck/run1/5/default", "ck/run1/5",
                "ck/run1/link-out", "ck/run1/link-out/x", "ck/run1/link-out/x/z",
                "ck/run1/link-in", "ck/run1/link-in/y", "ck/run1/..", "ck/run1/../run1/.",
                "ck/run1//5", "ck/run1/5/"]


def test_a_call_resolves_each_path_as_realpath_does_symlinks_and_dots_too(root, tmp_path):
  (root / "run1" / "link-out").symlink_to(tmp_path / "outside")
  (root / "run1" / "link-in").symlink_to(root / "run1" / "5")
  roots = roots_lib.Roots(0, (str(tmp_path),))

  @roots_lib.resolved_once
  def call() -> list[str]:
    return [roots.resolve(str(tmp_path / p), "p") for p in _IN_ONE_CALL * 2]

  assert call() == [os.path.realpath(tmp_path / p) for p in _IN_ONE_CALL * 2]


def test_a_symlink_in_a_resolved_directory_still_leaves_the_root(root, tmp_path):
  (root / "run1" / "escape").symlink_to(tmp_path / "outside")
  roots = roots_lib.Roots(0, (str(root),))

  @roots_lib.resolved_once
  def call(name: str) -> str:
    roots.resolve(str(root / "run1"), "directory")  # its directory, resolved first
    return roots.resolve(str(root / "run1" / name), "tmp_dir")

  tmp = "5.orbax-checkpoint-tmp"
  assert call(tmp) == os.path.realpath(root / "run1" / tmp)
  for name, where in (("escape", "outside"), ("escape/deeper", "outside/deeper")):
    with pytest.raises(errors.PermissionDeniedError, match=rf"tmp_dir .*{name}' \(resolved: "
                       rf"'{tmp_path / where}'\) is not under a checkpoint root"):
      call(name)


def test_a_call_resolves_a_path_once_and_one_in_its_directory_by_one_lstat(
    root, tmp_path, monkeypatch):
  roots = roots_lib.Roots(0, (str(root),))
  full = []
  realpath = os.path.realpath
  monkeypatch.setattr(roots_lib.os.path, "realpath",
                      lambda p: full.append(p) or realpath(p))
  directory = str(root / "run1")

  @roots_lib.resolved_once
  def stage() -> None:
    for path in (directory, f"{directory}/5.orbax-checkpoint-tmp", directory,
                 f"{directory}/5/default", f"{directory}/5.orbax-checkpoint-tmp/default"):
      roots.resolve(path, "p")

  stage()
  assert full == [directory]
  stage()  # nothing kept from call to call
  assert full == [directory, directory]
  roots.resolve(directory, "p")  # outside a call: as before
  assert full == [directory] * 3
