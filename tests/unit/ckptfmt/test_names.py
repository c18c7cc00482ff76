"""Names, not paths (issue 42): what a client may call a file, and opening it beneath its
directory without following a symlink."""

import os

import pytest

from sidecar._src.ckptfmt import names
from sidecar._src.core import errors

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("value", "why"), [
    ("/etc/passwd", "not an absolute path"), ("..", "'..' component"),
    ("a/../../b", "'..' component"), ("a//b", "empty"), (".", "empty, '.' or"),
    ("a\0b", "no NUL"), ("", "a non-empty string"), (7, "a non-empty string"),
    ("x" * 256, "each component at most 255 bytes"), ("a/" * 2049, "at most 4096 bytes")],
    ids=["absolute", "dotdot", "dotdot-inside", "empty-part", "dot", "nul", "empty", "int",
         "long-part", "long"])
def test_what_is_no_name_is_refused_naming_the_field_and_the_fix(value, why):
  with pytest.raises(errors.InvalidArgumentError,
                     match=rf"leaf must be a name relative to its checkpoint directory "
                     rf"\(.*{why}.*\), got .*; the fix"):
    names.check_name(value, "leaf", fix="the fix")


@pytest.mark.parametrize("value", ["w", "opt.0.mu", "a/b", "a..b", "..a", ".hidden"])
def test_names(value):
  assert names.check_name(value, "leaf") == value


def test_a_file_opens_beneath_its_directory_and_never_through_a_symlink(tmp_path):
  base, outside = tmp_path / "base", tmp_path / "outside"
  base.mkdir()
  outside.mkdir()
  fd = names.open_beneath(base, "a/b/c", os.O_WRONLY | os.O_CREAT, make_dirs=True)
  os.close(fd)
  assert (base / "a" / "b" / "c").is_file()
  (base / "link").symlink_to(outside)  # a directory swapped for a symlink
  (base / "file").symlink_to(outside / "f")
  for name in ("link/x", "file"):
    with pytest.raises(OSError) as info:
      os.close(names.open_beneath(base, name, os.O_WRONLY | os.O_CREAT, make_dirs=True))
    assert str(base / name) in str(info.value)
  assert list(outside.iterdir()) == []
  with pytest.raises(errors.InvalidArgumentError):
    names.open_beneath(base, "../outside/x", os.O_WRONLY | os.O_CREAT)
  with pytest.raises(errors.PermissionDeniedError, match="outside its checkpoint directory"):
    names.check_beneath(base, base / "link" / "x", "leaf")
  assert names.check_beneath(base, base / "a" / "b", "leaf") == base / "a" / "b"
