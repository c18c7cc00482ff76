import re
import sys

import pytest

import sidecar
from sidecar._src.user import registry as registry_lib

pytestmark = pytest.mark.unit


def test_decorator_forms_register_and_return_unchanged(registry):
  def f(x):
    return x

  assert sidecar.function(f) is f
  g = sidecar.function(name="renamed")(lambda: 1)
  assert registry.get("function", "f").fn is f
  assert registry.get("function", "renamed").fn is g
  assert registry.names("function") == ["f", "renamed"]


def test_duplicate_name_raises(registry):
  @sidecar.function
  def twice():
    pass

  with pytest.raises(sidecar.AlreadyRegisteredError, match="'twice' is already registered"):
    sidecar.function(name="twice")(lambda: None)
  assert issubclass(sidecar.AlreadyRegisteredError, ValueError)


def test_non_callable_raises_type_error(registry):
  with pytest.raises(TypeError, match="needs a callable, got int 3"):
    sidecar.function(3)
  with pytest.raises(TypeError, match="needs a callable"):
    sidecar.function(name="x")("not callable")


def test_unknown_name_lists_registered(registry):
  sidecar.function(name="alpha")(lambda: 0)
  with pytest.raises(sidecar.NotRegisteredError, match=r"'nope'.*registered functions: alpha"):
    registry.get("function", "nope")
  assert issubclass(sidecar.NotRegisteredError, KeyError)


def test_fingerprint_tracks_names_and_code():
  r1, r2, r3 = registry_lib.Registry(), registry_lib.Registry(), registry_lib.Registry()

  def a():
    return 1

  def b():
    return 2

  r1.add("function", "f", a)
  r2.add("function", "f", a)
  r3.add("function", "f", b)
  assert r1.fingerprint() == r2.fingerprint()
  assert r1.fingerprint() != r3.fingerprint()
  r2.add("function", "g", a)
  assert r1.fingerprint() != r2.fingerprint()


def test_explicit_registry_argument():
  r = registry_lib.Registry()
  sidecar.function(name="only_here", registry=r)(lambda: 0)
  assert r.names("function") == ["only_here"]
  assert "only_here" not in sidecar.default_registry().names("function")


def test_a_module_that_needs_a_missing_extra_names_the_extra(tmp_path, monkeypatch):
  # A user's module of pipelines imports grain, which a PyTorch-only install lacks.
  (tmp_path / "needs_grain_fns.py").write_text("import grain_not_installed_probe\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(registry_lib.extras.EXTRA_OF, "grain_not_installed_probe", "jax")
  with pytest.raises(ImportError, match=r"cannot import 'needs_grain_fns' given with --import: "
                     r".*grain_not_installed_probe.*; pip install 'colocated-sidecar\[jax\]'"):
    registry_lib.load_modules(["needs_grain_fns"])
  (tmp_path / "broken_fns.py").write_text("import no_such_module_anywhere\n")
  with pytest.raises(ImportError, match=r"given with --import: No module named "
                     r"'no_such_module_anywhere'$"):
    registry_lib.load_modules(["broken_fns"])


def test_a_module_not_found_names_the_working_directory_sys_path_and_the_fix(
    tmp_path, monkeypatch):
  # Issue 55 item 7: `--import my_fns` from another directory said only "No module named
  # 'my_fns'", nothing of where Python looked nor how to make it look elsewhere.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", ["/first/on/path", *sys.path])
  with pytest.raises(ImportError, match=(
      r"^cannot import 'my_fns_not_here\.pipelines' given with --import: No module named "
      r"'my_fns_not_here'; Python looked on sys.path \(/first/on/path, .*\) from the "
      rf"working directory {re.escape(str(tmp_path))}: start the sidecar from the directory "
      r"that holds my_fns_not_here\.py or my_fns_not_here/, or set PYTHONPATH to that "
      r"directory$")):
    registry_lib.load_modules(["my_fns_not_here.pipelines"])


def test_a_pipeline_may_name_its_data_a_function_may_not():
  reg = registry_lib.Registry()

  def name_of(ctx, *, path):
    return f"data at {path}"

  @sidecar.pipeline(registry=reg, identity=name_of)
  def records(ctx, *, path):
    return []

  assert reg.get("pipeline", "records").identity is name_of
  with pytest.raises(TypeError, match="identity= names the data a pipeline reads"):
    sidecar.function(registry=reg, identity=name_of)(lambda: None)
