"""Tier 1: where a step goes (target.py): a Target's directories are its format's, its tmp
ones Begin's answer and its final one the client's own spelling; which hosts hold a host's
replicas."""

import json
import pathlib

import numpy as np
import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.format import Format, Uncommitted
from sidecar._src.ckptfmt.records import Manifest, SavedLeaf
from sidecar._src.controller.checkpoint.target import Target, replica_hosts
from sidecar._src.core import errors
from tests.support.fake_sidecars import FakeSidecars, checkpointer

pytestmark = pytest.mark.unit

ORBAX, DCP = formats_lib.DEFAULT.get(formats_lib.ORBAX), formats_lib.DEFAULT.get(formats_lib.DCP)


class Layout(Format):
  """A format's directories only: what the trainer side asks a format (its save phases are
  the sidecar's, never called here)."""

  overwrites = False

  def create_tmp(self, directory, step):
    raise AssertionError("the sidecar's")

  def is_checkpoint(self, path):
    raise AssertionError("the sidecar's")

  def numbering(self, leaves):
    raise AssertionError("the sidecar's")

  def write(self, tmp_dir, host_id, numbering, incoming, *, progress, turn):
    raise AssertionError("the sidecar's")

  def commit(self, tmp_dir, manifest, *, leaves, num_hosts, whole_step, extra, swapping):
    raise AssertionError("the sidecar's")

  def read(self, final_dir, shard, *, allocate):
    raise AssertionError("the sidecar's")


class StepDirectory(Layout):
  """A step is one directory, ``<directory>/<step>``, written as ``<step>.steps-tmp`` beside
  it: no item inside (not Orbax's), begun from the root and the step (not DCP's)."""

  name, tmp_suffix = "steps", ".steps-tmp"

  def tmp_of(self, directory, step):
    return str(pathlib.Path(directory) / f"{step}{self.tmp_suffix}")

  def final_of(self, path):
    if not path.name.endswith(self.tmp_suffix):
      return None
    final = path.with_name(path.name.removesuffix(self.tmp_suffix))
    return Uncommitted(path, final, final)


class HiddenStaging(Layout):
  """A step is written in ``<directory>/.staging/<step>`` and committed to
  ``<directory>/<step>``; a save writes its item ``shards`` inside it."""

  name, tmp_suffix, item = "hidden", "", "shards"

  def tmp_of(self, directory, step):
    return str(pathlib.Path(directory) / ".staging" / str(step))

  def final_of(self, path):
    parts = path.parts
    if ".staging" not in parts[:-1]:
      return None
    at = parts.index(".staging")
    tmp = pathlib.Path(*parts[:at + 2])
    committed = pathlib.Path(*parts[:at]) / parts[at + 1]
    return Uncommitted(tmp, committed, committed / path.relative_to(tmp))


@pytest.mark.parametrize("fmt, begun, tmp_dir, final_dir", [
    (ORBAX, "/ckpt/7.orbax-checkpoint-tmp", "/ckpt/7.orbax-checkpoint-tmp/default",
     "/ckpt/7/default"),
    (StepDirectory(), "/ckpt/7.steps-tmp", "/ckpt/7.steps-tmp", "/ckpt/7"),
    (HiddenStaging(), "/ckpt/.staging/7", "/ckpt/.staging/7/shards", "/ckpt/7/shards"),
], ids=["orbax", "step-directory", "hidden-staging"])
def test_a_step_is_where_its_format_puts_it(fmt, begun, tmp_dir, final_dir):
  """Target placed Orbax's item ('default') under every format's Begin answer."""
  target = Target.for_step(fmt, "/ckpt", 7)
  assert (target.directory, target.final_dir, target.tmp_dir, target.whole_step) == (
      "/ckpt", final_dir, "", True)
  target = target.begun(begun)
  assert (target.tmp_step, target.tmp_dir, target.final_dir) == (begun, tmp_dir, final_dir)


def test_a_dcp_checkpoint_is_its_own_directory_begun_beside_it():
  target = Target.for_step(DCP, "/ckpt/run/3", 3, directory="/ckpt/run").begun(
      "/ckpt/run/3.dcp-checkpoint-tmp")
  assert (target.directory, target.tmp_step, target.tmp_dir, target.final_dir) == (
      "/ckpt/run", "/ckpt/run/3.dcp-checkpoint-tmp", "/ckpt/run/3.dcp-checkpoint-tmp",
      "/ckpt/run/3")


def test_the_final_directory_stays_the_clients_own_spelling(tmp_path):
  """Begin answers the resolved tmp directory; the step's final directory (the manifest's,
  the RAM tier's key, what a restore reads) is still the path the client named: through a
  symlink, or relative."""
  real = tmp_path / "real"
  real.mkdir()
  link = tmp_path / "link"
  link.symlink_to(real)
  target = Target.for_step(ORBAX, str(link), 5).begun(str(real / "5.orbax-checkpoint-tmp"))
  assert target.tmp_dir == str(real / "5.orbax-checkpoint-tmp" / "default")
  assert target.final_dir == str(link / "5" / "default")
  target = Target.for_step(DCP, str(link / "5"), 5, directory=str(link)).begun(
      str(real / "5.dcp-checkpoint-tmp"))
  assert (target.tmp_dir, target.final_dir) == (str(real / "5.dcp-checkpoint-tmp"),
                                                str(link / "5"))
  assert Target.for_step(ORBAX, "ck", 5).final_dir == "ck/5/default"
  assert Target.for_step(StepDirectory(), "ck", 5).final_dir == "ck/5"


def test_begin_answering_another_formats_directory_is_refused():
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"not an uncommitted step directory of format 'steps'"):
    Target.for_step(StepDirectory(), "/ckpt", 7).begun("/ckpt/7.orbax-checkpoint-tmp")


def test_an_item_another_commits_goes_where_its_format_renames_its_step():
  item = "/ckpt/7.orbax-checkpoint-tmp-1700000000/state"
  target = Target.in_step(ORBAX, "/ckpt", item, 7)
  assert (target.directory, target.tmp_dir, target.final_dir, target.whole_step,
          target.tmp_step) == ("/ckpt", item, "/ckpt/7/state", False, "")
  # An item already in its step's own directory stays where it is.
  assert Target.in_step(ORBAX, "/ckpt", "/ckpt/7/state", 7).final_dir == "/ckpt/7/state"


class LayoutSidecars(FakeSidecars):
  """Sidecars that save in ``fmt``: begin answers its tmp directory, a commit puts the step
  where its ``final_of`` says; records where each stage wrote."""

  def __init__(self, fmt, **kw):
    super().__init__(**kw)
    self.fmt, self.staged_at = fmt, []

  def begin(self, host, directory, step, *, format):
    assert format == self.fmt.name, format
    return self._phase("begin", host, self.fmt.tmp_of(directory, step))

  def stage(self, host, *, tmp_dir, final_dir, **kw):
    self.staged_at.append((tmp_dir, final_dir))
    return super().stage(host, tmp_dir=tmp_dir, final_dir=final_dir, **kw)

  def commit(self, host, *, tmp_dir, step, num_hosts, leaves, shards, data_state_json,
             whole_step, replicas, timeout, extra=None):
    found = self.fmt.final_of(pathlib.Path(tmp_dir))
    self.manifests[str(found.final)] = Manifest(
        self.fmt.name, tuple(SavedLeaf.of(s) for s in leaves), tuple(shards),
        json.loads(data_state_json) if data_state_json else None, {}, step=step)
    self.steps.setdefault(str(found.committed.parent), set()).add(step)
    return self._phase("commit", host, str(found.final))


@pytest.mark.parametrize("fmt", [StepDirectory(), HiddenStaging()], ids=lambda f: f.name)
def test_a_new_formats_layout_needs_nothing_on_the_trainer_side(fmt, monkeypatch):
  """A format registered with a layout of its own (neither Orbax's item nor DCP's one
  directory) is saved, listed and restored by the one Checkpointer with no trainer-side
  change: every directory is the format's."""
  monkeypatch.setattr(formats_lib, "DEFAULT", formats_lib.DEFAULT.replacing(fmt))
  fake = LayoutSidecars(fmt, hosts=(0,))
  w = np.arange(6, dtype=np.float32)
  with checkpointer(fake, format=fmt.name) as ckpt:
    assert ckpt.save(7, {"w": w}, data_state={"at": 7}).durable.result(30) == 7
    assert ckpt.all_steps() == [7]
    restored = ckpt.restore(7, {"w": np.zeros(6, np.float32)})
    assert ckpt.data_state(7) == {"at": 7}
  np.testing.assert_array_equal(restored["w"], w)
  tmp_dir, final_dir = fmt.staged_dirs(fmt.tmp_of("/ckpt/run", 7))
  assert set(fake.staged_at) == {(tmp_dir, final_dir)}
  assert list(fake.manifests) == [final_dir]


@pytest.mark.parametrize("slices, host, replicas, expected", [
    ({0: 0, 1: 0, 2: 0}, 0, 1, [1]),
    ({0: 0, 1: 0, 2: 0}, 2, 2, [0, 1]),  # wraps
    ({0: 0, 1: 0, 2: 1, 3: 1}, 0, 1, [2]),  # another slice first
    ({0: 0, 1: 0, 2: 1, 3: 1}, 3, 2, [0, 1]),
    ({0: 0, 1: 0, 2: 1, 3: 1}, 1, 3, [2, 3, 0]),  # then its own slice
], ids=["next", "wrap", "other-slice", "other-slice-wrap", "then-same-slice"])
def test_replica_hosts(slices, host, replicas, expected):
  assert replica_hosts(slices, host, replicas) == expected
