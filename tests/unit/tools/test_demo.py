"""``sidecar demo``'s log file, without running the demo."""

import logging
import os
import stat
import tempfile

import pytest

from sidecar._src.tools import demo

pytestmark = pytest.mark.unit


def test_each_run_logs_to_a_file_of_its_own_and_keeps_it(monkeypatch, tmp_path):
  # Before: every run wrote $TMPDIR/sidecar-demo.log with mode "w", the last one's only.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  paths = []
  for run in ("first", "second"):
    with demo._quiet(verbose=False) as path:
      logging.getLogger("sidecar.test").warning("run %s", run)
    paths.append(path)
  assert paths[0] != paths[1]
  assert sorted(tmp_path.iterdir()) == sorted(map(type(tmp_path), paths))
  for path, run in zip(paths, ("first", "second")):
    assert os.path.basename(path).startswith("sidecar-demo-") and path.endswith(".log")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # mkstemp's: this user's only
    with open(path) as f:
      assert f"run {run}" in f.read()
  with demo._quiet(verbose=True) as path:  # --verbose: no file at all
    assert path is None
  assert len(list(tmp_path.iterdir())) == 2
