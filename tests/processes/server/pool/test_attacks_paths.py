"""Isolation, round 7, items 1-3 (issue 70): bob, a second pool tenant, attacks alice's data
and the sidecar's descriptors through his own data root. One pool sidecar in its own
process (root), public API only; bob's root and everything in it belong to a Unix user of
his own (uid ``nobody``), alice's dataset is 0600 in her 0700 root.

Before: (1) bob's TFDS dataset whose ``dataset_info.json`` named alice's shards in
``splits[].filepathTemplate`` (absolute, or ``../`` x16 up to hers) fed him her examples;
(2) eight symlinks to ``.`` in his root and a nine-level Parquet glob kept the sidecar at a
full core, its memory growing, with no answer, long after he left; (3) his feeds of padded
TFDS datasets held one descriptor per file, counted by nothing, until the sidecar's table
was full and alice's handshake failed with ``builtins.OSError`` (EMFILE).
"""

import json
import os
import pathlib
import pwd
import secrets
import shutil
import time

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds_lib
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually
from tests.support.pool_files import ALICE, BOB, write_pool

pytestmark = pytest.mark.processes

try:
  NOBODY = pwd.getpwnam("nobody").pw_uid
except KeyError:
  NOBODY = 65534
BOB_FILES = 30  # bob's open_files: one view of his padded dataset (23 files) fits, two do not
PADDING = 20
# Round 8 (issue 76), attack 8: his views of a dataset directory of many (empty)
# directories, in his own temporary directory, which holds BOB_TMP: two views do not fit.
BOB_TMP = 1 << 20
DIRS = 150
POOL = f"""\
tenants:
  - {{name: alice, token_file: alice.token, checkpoint_roots: [alice]}}
  - {{name: bob, token_file: bob.token, checkpoint_roots: [bob], open_files: {BOB_FILES},
     tmp_bytes: 1MiB}}
"""
NAME = "sidecar_attack_tiny"
ALICE_BASE = 1000.0  # alice's examples are 1000.., bob's 0..
_base = [0.0]


class SidecarAttackTiny(tfds_lib.core.GeneratorBasedBuilder):
  """Registered with TFDS as ``sidecar_attack_tiny``: 6 train examples from ``_base``."""
  VERSION = tfds_lib.core.Version("1.0.0")

  def _info(self):
    return tfds_lib.core.DatasetInfo(builder=self, features=tfds_lib.features.FeaturesDict({
        "x": tfds_lib.features.Tensor(shape=(2,), dtype=np.float32)}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i in range(6):
      yield i, {"x": np.full((2,), _base[0] + i, np.float32)}


def _prepare(data_dir: pathlib.Path, base: float) -> pathlib.Path:
  """The dataset prepared in ``data_dir``; its version directory."""
  _base[0] = base
  tfds_lib.disable_progress_bar()
  SidecarAttackTiny(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
  shutil.rmtree(data_dir / "downloads", ignore_errors=True)
  return data_dir / NAME / "1.0.0"


def _hostile(version: pathlib.Path, template: str) -> None:
  """bob's edit: every split's shards named by ``template``, his own shards gone."""
  info = json.loads((version / "dataset_info.json").read_text())
  for split in info["splits"]:
    split["filepathTemplate"] = template
  (version / "dataset_info.json").write_text(json.dumps(info))
  for shard in version.glob("*.array_record-*"):
    shard.unlink()


@pytest.fixture(scope="module")
def pool():
  """The pool sidecar and its directory (see the module's docstring)."""
  if os.geteuid() != 0:
    pytest.skip(f"a second Unix user needs root here (chown to uid {NOBODY}); this runs as "
                f"uid {os.geteuid()}; the checks are in tests/unit/ (user/, pipelines/)")
  base = pathlib.Path(f"/tmp/sidecar-attacks-{secrets.token_hex(6)}")
  base.mkdir(0o755)
  try:
    path = write_pool(base, POOL)
    alice, bob = base / "alice", base / "bob"
    hers = _prepare(alice / "tfds", ALICE_BASE)
    for p in alice.rglob("*"):
      os.chmod(p, 0o700 if p.is_dir() else 0o600)
    os.chmod(alice, 0o700)
    _prepare(bob / "own", 0.0)
    padded = _prepare(bob / "padded", 0.0)
    for i in range(PADDING):  # a dataset directory of many files, each held by its view
      (padded / f"pad-{i}.txt").write_bytes(b"x")
    dirs = _prepare(bob / "dirs", 0.0)
    for i in range(DIRS):  # a dataset directory of many directories, each made by its view
      (dirs / f"pad-{i}").mkdir()
    theirs = f"{hers}/{{DATASET}}-{{SPLIT}}.{{FILEFORMAT}}-{{SHARD_X_OF_Y}}"
    _hostile(_prepare(bob / "abs", 0.0), theirs)
    _hostile(_prepare(bob / "dotdot", 0.0), "../" * 16 + theirs.lstrip("/"))
    (bob / "loop").mkdir()
    (bob / "loop" / "t.txt").write_bytes(b"x")
    for i in range(8):
      os.symlink(".", bob / "loop" / f"l{i}")
    for p in [bob, *bob.rglob("*")]:
      os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    (base / "sidecar-tmp").mkdir()  # the sidecar's own temporary directory
    with sidecar.testing.LocalCluster(
        1, 1, shm_size="32MiB", pool=path, checkpoint_roots=[str(base)],
        imports=["pipelines.tfds", "pipelines.parquet"],
        host_env={0: {"TMPDIR": str(base / "sidecar-tmp")}}) as cluster:
      yield cluster, base
  finally:
    shutil.rmtree(base, ignore_errors=True)


ROWS = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


def _feed(ctl, data_dir):
  return ctl.feed("tfds", global_batch_size=2, sharding=ROWS,
                  kwargs={"name": NAME, "split": "train", "data_dir": str(data_dir)})


def _xs(ctl, data_dir):
  with _feed(ctl, data_dir) as feed:
    return {float(v) for _ in range(3) for v in np.asarray(next(feed)["x"])[:, 0]}


def _refused(ctl, name, kwargs):
  """The typed error bob's feed raises; no host was lost, nothing of alice's in it."""
  with pytest.raises(sidecar.SidecarError) as e:
    with ctl.feed(name, global_batch_size=2, sharding=ROWS, kwargs=kwargs) as feed:
      next(feed)
  assert not isinstance(e.value, sidecar.HostLostError), repr(e.value)
  # The sidecar's refusal, of a typed kind (about a pipeline, also a PipelineError that keeps
  # that kind), never an untyped error raised in the pipeline.
  assert isinstance(e.value, (sidecar.PermissionDeniedError, sidecar.NotFoundError,
                              sidecar.InvalidArgumentError, sidecar.ResourceExhaustedError)
                    ), repr(e.value)
  assert str(ALICE_BASE) not in str(e.value)
  return e.value


@pytest.mark.timeout(300)
def test_tfds_templates_naming_alices_shards_are_refused(pool):
  cluster, base = pool
  with cluster.controller(token=ALICE) as alice:  # hers to read
    assert _xs(alice, base / "alice" / "tfds") <= {ALICE_BASE + i for i in range(6)}
  with cluster.controller(token=BOB) as bob:
    assert _xs(bob, base / "bob" / "own") <= set(range(6))  # his own, as before
    e = _refused(bob, "tfds", {"name": NAME, "split": "train",
                               "data_dir": str(base / "alice" / "tfds")})
    assert isinstance(e, sidecar.PermissionDeniedError) and "is not under" in str(e)
    for hostile in ("abs", "dotdot"):  # his own data_dir, its metadata naming hers
      e = _refused(bob, "tfds", {"name": NAME, "split": "train",
                                 "data_dir": str(base / "bob" / hostile)})
      assert isinstance(e, sidecar.PermissionDeniedError), (hostile, repr(e))
      assert "its dataset_info.json has split 'train' read from" in str(e), str(e)
      assert "outside the dataset's own directory" in str(e)


@pytest.mark.timeout(120)
def test_a_glob_through_symlink_loops_ends_with_an_answer(pool):
  cluster, base = pool
  loop = base / "bob" / "loop"
  with cluster.controller(token=BOB) as bob:
    e = _refused(bob, "parquet", {"paths": f"{loop}/{'*/' * 8}*.parquet"})
    assert isinstance(e, sidecar.NotFoundError) and "no Parquet file at" in str(e)
  with cluster.controller(token=ALICE) as alice:  # the sidecar is free for her
    assert _xs(alice, base / "alice" / "tfds")


@pytest.mark.timeout(300)
def test_bobs_open_files_are_his_share_and_alice_is_served(pool):
  cluster, base = pool
  with cluster.controller(token=BOB) as bob:
    with _feed(bob, base / "bob" / "padded") as first:  # 23 files held while it lives
      next(first)
      e = _refused(bob, "tfds", {"name": NAME, "split": "train",
                                 "data_dir": str(base / "bob" / "padded")})
      assert isinstance(e, sidecar.ResourceExhaustedError), repr(e)
      assert (f"tenant 'bob''s feeds hold {BOB_FILES} open files; one more file for the "
              "view of" in str(e)
              and f"would pass its quota (open_files={BOB_FILES}, " in str(e)
              and "close feeds that are done" in str(e)), str(e)
      with cluster.controller(token=ALICE) as alice:  # her handshake and feed meanwhile
        assert _xs(alice, base / "alice" / "tfds")
    # His first feed closed: its files given back at once (not when the collector finds a
    # cycle that holds its dataset), the same feed is served again.
    assert _xs(bob, base / "bob" / "padded") <= set(range(6))


@pytest.mark.timeout(300)
def test_tfds_views_land_in_bob_s_own_bounded_temporary_directory(pool):
  """Round 8 (issue 76), attack 8: eight feeds' TFDS views wrote 314 MiB of directories in
  the sidecar's /tmp, past the manifests' 256 MiB limit; only their files were counted."""
  cluster, base = pool
  mine = base / "sidecar-tmp"
  with cluster.controller(token=BOB) as bob:
    with _feed(bob, base / "bob" / "dirs") as first:
      next(first)
      # His view is his process's: in his own temporary directory, none in the sidecar's.
      assert not [n for n in os.listdir(mine) if n.startswith("sidecar-view-")]
      views = list(mine.glob("sidecar-tenants-*/bob-*/sidecar-view-*"))
      assert len(views) == 1 and len(list(views[0].rglob("pad-*"))) == DIRS
      with pytest.raises(sidecar.ResourceExhaustedError) as e:
        with _feed(bob, base / "bob" / "dirs") as second:  # views of ~600 KiB: past it
          next(second)
          time.sleep(1.5)  # the sidecar looks every half second
          for _ in range(20):  # (batches made before it looked come first)
            next(first)
            next(second)
      assert "tenant 'bob''s process held more than its temporary directory may" in str(e.value)
      assert f"(tmp_bytes={BOB_TMP >> 20}.0 MiB, {base}/pool.yaml:" in str(e.value)
    # Past it, his process was stopped and its directory emptied (a feed of his that
    # started again since gives its view back as it ends); his next feed is served.
    assert eventually(lambda: not list(mine.glob("sidecar-tenants-*/bob-*/sidecar-view-*")))
    assert _xs(bob, base / "bob" / "own") <= set(range(6))
  with cluster.controller(token=ALICE) as alice:  # hers, in her own process, meanwhile
    assert _xs(alice, base / "alice" / "tfds")
