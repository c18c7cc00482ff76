"""``sidecar launch`` shows each sidecar's warnings and errors while the job runs, prefixed
``[sidecar i]``, and keeps the sidecars' whole logs in a directory of the launch, named at
start, after it ends.

A save fails in the sidecar with ENOSPC (fault injection, ``enospc@1``: the write of step 1
fails once its first bytes are on disk), while its trainer (tests/support/save_trainer.py)
waits: the sidecar's ERROR line must show in the launch's output before the job ends.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from sidecar._src.core import env as env_lib
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def test_a_sidecars_error_shows_while_the_job_runs_and_its_log_is_kept(tmp_path):
  release = tmp_path / "release"
  p = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "16MiB",
       "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-m",
       "tests.support.save_trainer", str(tmp_path / "ckpt"), str(release)],
      cwd=ROOT, env=dict(os.environ, **{env_lib.CKPT_FAULT: "enospc@1"}),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    err = ""
    while "[sidecar 0]" not in err:
      line = p.stderr.readline()
      assert line, err + p.communicate(timeout=30)[0]
      err += line
    assert p.poll() is None  # the trainer still waits: the job runs
    (shown,) = [line for line in err.splitlines() if line.startswith("[sidecar 0]")]
    assert re.match(r"\[sidecar 0\] \S+ \S+ ERROR \S+: step 1: writing this host's part "
                    r"failed: .*No space left on device", shown), shown
    (where,) = re.findall(r"the sidecars' logs go to (\S+)/host<i>\.log", err)
    assert pathlib.Path(where).parent == tmp_path / "logs"
  finally:
    release.touch()
    _, rest = p.communicate(timeout=60)
  # The sidecars and their temp directory are gone; the log stays, whole.
  kept = (pathlib.Path(where) / "host0.log").read_text()
  assert shown.removeprefix("[sidecar 0] ") in kept
  assert "INFO" in kept and "serving on" in kept, kept  # what was not shown too
  assert "[sidecar 0] " + kept.splitlines()[0] not in err + rest  # INFO lines are not shown
