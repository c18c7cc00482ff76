"""Orbax's libraries imported once for the process (issue 76, attack 2): a failed import
is one clear error, the same for every caller, naming what to install; a Begin in Orbax's
layout on a sidecar without them is refused before anything is made. The burst itself, on
a fresh sidecar, is tests/processes/ckptfmt/test_import_burst.py."""

import concurrent.futures
import threading

import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.orbax import libs
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.ckptfmt.save_values import Begin
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint import ram_tier, roots as roots_lib, save as checkpoint_save
from sidecar._src.server.checkpoint.caller import Caller

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch):
  """As in a process that has not loaded them yet (here they are imported already)."""
  monkeypatch.setattr(libs, "_outcome", [])


def test_one_import_for_every_thread_that_asks(fresh, monkeypatch):
  calls, real = [], libs._import

  def counted():
    calls.append(threading.current_thread().name)
    return real()
  monkeypatch.setattr(libs, "_import", counted)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(lambda _: libs.load(), range(32)))
  assert len(calls) == 1 and libs._outcome == [("", None)]


def test_a_missing_library_is_one_error_naming_the_extra_for_every_caller(fresh, monkeypatch):
  monkeypatch.setattr(libs, "MODULES", ("tensorstore", "orbax.no_such_module_here"))
  for _ in range(2):  # the first, and every later one, alike
    with pytest.raises(ModuleNotFoundError,
                       match=r"a checkpoint in Orbax's layout needs orbax.no_such_module_here, "
                             r"which is not installed: pip install 'colocated-sidecar\[jax\]'"):
      libs.load()
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"format 'orbax' cannot be written or read by this sidecar: .*pip "
                           r"install 'colocated-sidecar\[jax\]'; or save in DCP's layout"):
    OrbaxFormat().load()
  assert formats_lib.DEFAULT.load_installed() == ["orbax"]


def test_a_begin_in_a_format_that_cannot_load_is_refused_before_anything_is_made(
    fresh, monkeypatch, tmp_path):
  monkeypatch.setattr(libs, "MODULES", ("orbax.no_such_module_here",))
  writer = checkpoint_save.StepWriter(
      0, tier=ram_tier.RamTier(0, uncommitted_s=3600.0),
      roots=roots_lib.Roots(0, (str(tmp_path),)), spawn=lambda *a, **k: None,
      metrics=metrics_lib.Recorder())
  with pytest.raises(errors.InvalidArgumentError, match="format 'orbax' cannot be written"):
    writer.begin(Begin(str(tmp_path / "ck"), 1, "orbax"), Caller(owner="a"))
  assert list(tmp_path.iterdir()) == []
  writer.begin(Begin(str(tmp_path / "ck" / "t"), 1, "dcp"), Caller(owner="a"))  # DCP's needs none
