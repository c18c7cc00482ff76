"""Which trainer commands a standby process can run (tools/standby.command); the standby
itself runs in tests/processes/tools/test_launch_standby.py."""

import importlib.util
import os
import sys
import time

import pytest

from sidecar._src.tools import standby

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("trainer, target", [
    (["python", "train.py", "--steps", "3"], ["train.py", "--steps", "3"]),
    (["/usr/bin/python3.11", "-m", "pkg.train", "-x"], ["-m", "pkg.train", "-x"]),
    (["python3", "dir/t.py"], ["dir/t.py"]),
])
def test_a_python_script_or_module_gets_a_standby_command(trainer, target):
  got = standby.command(trainer, ["optax", "grain"])
  assert got == [trainer[0], "-m", "sidecar._src.tools.standby", "--preload", "optax",
                 "--preload", "grain", "--", *target]


def test_a_command_run_by_env_passes_its_assignments():
  got = standby.command(["env", "JAX_LOG_COMPILES=1", "A=b=c", "python3", "t.py", "x"], [])
  assert got == ["python3", "-m", "sidecar._src.tools.standby", "--set", "JAX_LOG_COMPILES=1",
                 "--set", "A=b=c", "--", "t.py", "x"]


@pytest.mark.parametrize("trainer", [
    ["env", "-i", "python", "t.py"],  # env's own options: run as given
    ["env", "A=1", "bash", "t.sh"],
    ["bash", "-c", "python train.py"],  # not Python itself
    ["python"],  # no script
    ["python", "-c", "print(1)"],  # code on the command line
    ["python", "-u", "train.py"],  # an interpreter flag: run as given, not guessed at
    ["python", "-m"],  # no module
    ["torchrun", "train.py"],
])
def test_anything_else_gets_none(trainer):
  assert standby.command(trainer, []) is None


def test_the_report_flag_goes_before_the_trainer():
  got = standby.command(["python", "t.py"], [], report="/r/rank0.json")
  assert got == ["python", "-m", "sidecar._src.tools.standby", "--report", "/r/rank0.json",
                 "--", "t.py"]


def _imported(tmp_path, monkeypatch, name: str):
  """A module of ``tmp_path``, imported into this process (gone from it after the test)."""
  path = tmp_path / f"{name}.py"
  path.write_text("VERSION = 1\n")
  hour_ago = time.time_ns() - 3600 * 10**9  # not a tick a rewrite could share
  os.utime(path, ns=(hour_ago, hour_ago))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.setitem(sys.modules, name, module)
  return path


def test_a_module_or_script_changed_since_the_report_is_named(tmp_path, monkeypatch):
  module = _imported(tmp_path, monkeypatch, "standby_report_mod")
  script = tmp_path / "train.py"
  script.write_text("print(1)\n")
  os.utime(script, ns=(os.stat(module).st_mtime_ns,) * 2)
  report = str(tmp_path / "report.json")
  assert standby.changed_files(report) is None  # still importing: no report yet
  standby.write_report(report, time.time_ns(), str(script))
  assert standby.changed_files(report) == []
  module.write_text("VERSION = 2\n")  # the same size: its mtime tells
  assert standby.changed_files(report) == [str(module)]
  script.unlink()
  assert standby.changed_files(report) == [str(module), str(script)]


def test_a_file_modified_after_the_imports_began_counts_as_changed(tmp_path, monkeypatch):
  # It may have been read before its change or after: the standby cannot tell.
  module = _imported(tmp_path, monkeypatch, "standby_report_mod_late")
  report = str(tmp_path / "report.json")
  standby.write_report(report, os.stat(module).st_mtime_ns, None)
  assert str(module) in standby.changed_files(report)


def test_a_file_added_that_shadows_an_imported_module_is_found(tmp_path, monkeypatch):
  """Issue 70, item 8: a preloaded module fixed by a new file of its name beside the
  script (earlier on a fresh process's path) ran the old one, the launcher silent."""
  job, mods = tmp_path / "job", tmp_path / "mods"
  job.mkdir()
  mods.mkdir()
  installed = mods / "standby_shadowed_mod.py"
  installed.write_text("VERSION = 1\n")
  monkeypatch.setattr(sys, "path", [str(job), str(mods), *sys.path[1:]])
  spec = importlib.util.spec_from_file_location("standby_shadowed_mod", installed)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.setitem(sys.modules, "standby_shadowed_mod", module)
  report = str(tmp_path / "report.json")
  standby.write_report(report, time.time_ns(), None)
  assert standby.shadowed(report) == []  # nothing moved, editable installs' modules included
  (job / "standby_shadowed_mod.py").write_text("VERSION = 2\n")  # the fix, beside the script
  assert standby.changed_files(report) == []  # no file it imported changed...
  assert standby.shadowed(report) == [  # ... but a fresh process imports another
      ("standby_shadowed_mod", str(installed), str(job / "standby_shadowed_mod.py"))]
