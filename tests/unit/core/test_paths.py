"""The one test of whether a path lies in a directory (issue 42's review: it was written
eight times), by whole components."""

import pytest

from sidecar._src.core import paths

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("path", "directory", "inside", "beneath"), [
    ("/a/b", "/a/b", True, False), ("/a/b/c", "/a/b", True, True),
    ("/a/b/c", "/a/b/", True, True), ("/a/bc", "/a/b", False, False),
    ("/a", "/a/b", False, False), ("/x", "/", True, True), ("/", "/", True, False)],
    ids=["same", "below", "trailing-slash", "prefix-not-component", "above", "root", "root-itself"])
def test_inside_and_beneath_go_by_whole_components(path, directory, inside, beneath):
  assert paths.inside(path, directory) is inside
  assert paths.beneath(path, directory) is beneath
  assert paths.overlap(path, directory) is (inside or paths.inside(directory, path))
