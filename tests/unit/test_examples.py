"""The examples' own arguments, without running them."""

import importlib.util
import os
import pathlib
import tempfile

import pytest

pytestmark = pytest.mark.unit

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_torch_train_keeps_its_checkpoints_outside_the_checkout(monkeypatch, tmp_path):
  # Before: --dir defaulted to torch_ckpt, made in the working directory: the checkout,
  # where the README runs it.
  pytest.importorskip("torch")
  spec = importlib.util.spec_from_file_location("torch_train", EXAMPLES / "torch_train.py")
  assert spec is not None and spec.loader is not None
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  monkeypatch.chdir(EXAMPLES.parent)
  default = example.parse_args([]).dir
  assert os.path.isabs(default) and pathlib.Path(default).parent == pathlib.Path(
      tempfile.gettempdir())
  assert not pathlib.Path(default).is_relative_to(EXAMPLES.parent)
  assert example.parse_args([]).dir == default  # every rank and every run: the same one
  assert example.parse_args(["--dir", str(tmp_path)]).dir == str(tmp_path)


def test_torch_train_steps_count_global_steps_across_runs():
  """Issue 79 item 5: --steps counted each run's steps, so a job restarted at step 20 of
  30 ended at step 49 (tests/processes/examples/test_torch_train.py runs it)."""
  pytest.importorskip("torch")
  spec = importlib.util.spec_from_file_location("torch_train", EXAMPLES / "torch_train.py")
  assert spec is not None and spec.loader is not None
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  assert example.steps_left(0, 30) == range(0, 30)
  assert example.steps_left(20, 30) == range(20, 30)  # resumed: the steps left
  assert list(example.steps_left(30, 30)) == []  # nothing left: it says so
