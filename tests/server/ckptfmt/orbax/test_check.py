"""Tier 2: a restore returns the saved values or an error (issue 62 item 4), in Orbax's
layout, against an in-process sidecar and real files.

Each metadata file a restore reads is changed after the save, as a faulty disk, a tool or
a hand would: the ``.zarray`` (dtype, shape, chunks, fill value, order, compressor),
``_METADATA``, the manifest (edited; removed with a chunk's byte flipped). From storage
each is refused, naming the file relative to the step and the older step that is intact;
``fallback=True`` restores that one; from the RAM tier the saved values come back where
the changed file is not one the restore reads. No error names ``/proc/self/fd`` or a
``builtins`` type. A step stock Orbax wrote (which never had a manifest) still restores,
with a warning that it has no checksums.
"""

import json
import logging
import pathlib

import numpy as np
import orbax.checkpoint as ocp
import pytest

import sidecar

pytestmark = pytest.mark.server

N = 4096  # w[4000] is 4000.0: as int32 its bytes read 1165623296


def saved(step: int) -> dict:
  return {"w": np.arange(N, dtype=np.float32) + (step - 2), "b": np.full(3, step, np.int64)}


def target() -> dict:
  return {"w": np.zeros(N, np.float32), "b": np.zeros(3, np.int64)}


def _json(path: pathlib.Path, change) -> None:
  d = json.loads(path.read_text())
  change(d)
  path.write_text(json.dumps(d))


def _flip(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def _no_manifest_and_a_flip(item: pathlib.Path) -> None:
  (item / "sidecar_manifest.json").unlink()
  _flip(item / "w" / "0")


def _edit_manifest(item: pathlib.Path) -> None:
  path = item / "sidecar_manifest.json"
  path.write_text(path.read_text().replace('"dtype":"float32"', '"dtype":"int32"'))


def _reformat_manifest(item: pathlib.Path) -> None:  # jq . > file: every value as it was
  path = item / "sidecar_manifest.json"
  path.write_text(json.dumps(json.loads(path.read_text()), indent=2))


def _zarray(key, value):
  return lambda item: _json(item / "w" / ".zarray", lambda d: d.__setitem__(key, value))


def _metadata(change):
  return lambda item: _json(item / "_METADATA", change)


# (what is changed, how, the file the error names, whether a RAM-tier restore reads it)
CORRUPTIONS = {
    "dtype": (_zarray("dtype", "<i4"),
              r"default/w/\.zarray says dtype int32 \('<i4'\) where the save wrote float32",
              False),
    "shape": (_zarray("shape", [N // 2]),
              r"default/w/\.zarray says shape: \[2048\] where the save wrote \[4096\]", False),
    "chunks": (_zarray("chunks", [N // 2]),
               r"default/w/\.zarray says chunks: \[2048\] where the save wrote \[4096\]", False),
    "fill_value": (_zarray("fill_value", 1.5),
                   r"default/w/\.zarray says fill_value: 1.5 where the save wrote null", False),
    "order": (_zarray("order", "F"), r"default/w/\.zarray says order: \"F\"", False),
    "compressor": (_zarray("compressor", {"id": "zstd", "level": 1}),
                   r"default/w/\.zarray says compressor: .* where the save wrote null", False),
    "_METADATA kind": (_metadata(lambda d: d["tree_metadata"]["('w',)"]["value_metadata"]
                                 .__setitem__("value_type", "scalar")),
                       r"default/_METADATA says leaf 'w' is a 'scalar' where the save wrote a "
                       r"'np.ndarray'", False),
    "_METADATA zarr3": (_metadata(lambda d: d.__setitem__("use_zarr3", True)),
                        r"default/_METADATA says use_zarr3: True", False),
    "manifest removed, a byte flipped": (
        _no_manifest_and_a_flip, r"default/sidecar_manifest\.json is missing, but the "
        r"item's _METADATA says a sidecar wrote it", True),
    "manifest edited": (_edit_manifest, r"sidecar_manifest\.json does not match the crc32c "
                        "it was written with", True),
    "manifest reformatted": (_reformat_manifest, r"sidecar_manifest\.json has a crc32c that "
                             "no longer heads it", True),
}


@pytest.fixture
def steps(make_server, tmp_path):
  """A controller and a checkpointer of ``tmp_path/ck`` with steps 1 and 2 durable."""
  server = make_server(shm_size=16 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=30) as ctl:
    with ctl.checkpointer(tmp_path / "ck") as ckpt:
      for step in (1, 2):
        ckpt.save(step, saved(step)).durable.result(60)
      ckpt.wait()
      yield ctl, ckpt, tmp_path / "ck"


def _clean(error: BaseException) -> str:
  text = str(error)
  assert "/proc/self/fd" not in text and "builtins." not in text, text
  return text


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_step_changed_on_disk_is_refused_named_and_skipped_by_fallback(steps, name):
  ctl, ckpt, directory = steps
  change, names, _ = CORRUPTIONS[name]
  change(directory / "2" / "default")
  ckpt.drop_ram_tier()  # from storage
  with pytest.raises(sidecar.CorruptCheckpointError, match=names) as refused:
    ckpt.restore(2, target())
  text = _clean(refused.value)
  assert "older committed steps that check intact: [1]" in text, text
  back = ckpt.restore(target=target(), fallback=True)
  assert ckpt.restored_step == 1 and ckpt.latest_step() == 2
  np.testing.assert_array_equal(back["w"], saved(1)["w"])
  np.testing.assert_array_equal(back["b"], saved(1)["b"])


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_from_the_ram_tier_the_saved_values_or_an_error(steps, name):
  ctl, ckpt, directory = steps
  change, names, read_from_ram = CORRUPTIONS[name]
  change(directory / "2" / "default")
  if read_from_ram:  # the manifest is read from storage: the step is refused
    with pytest.raises(sidecar.CorruptCheckpointError, match=names) as refused:
      ckpt.restore(2, target())
    _clean(refused.value)
    return
  back = ckpt.restore(2, target())  # the RAM copies, checked by crc32c: as saved
  assert ckpt.last_restore_stats().shards == {"ram:host0": 2}
  assert back["w"][4000] == 4000.0
  np.testing.assert_array_equal(back["w"], saved(2)["w"])


def test_the_int32_reading_of_a_float32_leaf_is_refused_at_its_read(steps):
  """Before: 1165623296 for 4000.0. The shard's own read checks its .zarray too, not only
  the manifest's Info: a Read rpc straight to storage is refused the same."""
  ctl, ckpt, directory = steps
  ckpt.drop_ram_tier()
  final_dir = str(directory / "2" / "default")
  client = ctl.checkpoint_client()
  manifest = client.info(0, final_dir).result()
  (w,) = [s for s in manifest.shards if s.key_path == ("w",)]
  CORRUPTIONS["dtype"][0](directory / "2" / "default")
  with pytest.raises(sidecar.CorruptCheckpointError, match=r"\.zarray says dtype int32") as e:
    client.read(0, final_dir, w, tier="disk").result()
  _clean(e.value)


def test_fallback_restores_nothing_it_cannot_and_says_each_step(steps):
  ctl, ckpt, directory = steps
  for step in ("1", "2"):
    CORRUPTIONS["dtype"][0](directory / step / "default")
  ckpt.drop_ram_tier()
  with pytest.raises(sidecar.CorruptCheckpointError,
                     match=r"no committed step of .* restores whole: step 2: .*; step 1: "):
    ckpt.restore(target=target(), fallback=True)
  with pytest.raises(sidecar.CorruptCheckpointError,
                     match=r"no older committed step checks intact \(\[1\] do not\)"):
    ckpt.restore(target=target())


def test_chunks_halved_in_a_stock_step_say_the_file_not_a_descriptor(steps, tmp_path):
  """Before: ``RemoteError: builtins.ValueError: FAILED_PRECONDITION: Error reading local
  file "/proc/self/fd/18/w/0"``. A stock step has no manifest to compare with: the read's
  own error, as a corrupt checkpoint's, naming the file by its path."""
  ctl, _, _ = steps
  directory = tmp_path / "stock"
  zarr2 = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)  # a .zarray per leaf
  with ocp.CheckpointManager(directory, item_handlers=zarr2) as mngr:
    mngr.save(1, args=ocp.args.PyTreeSave(saved(1)))
    mngr.wait_until_finished()
  _json(directory / "1" / "default" / "w" / ".zarray",
        lambda d: d.__setitem__("chunks", [N // 2]))
  with ctl.checkpointer(directory) as ckpt, pytest.raises(sidecar.CorruptCheckpointError) as e:
    ckpt.restore(1, target())
  assert "default/w" in _clean(e.value)


def test_a_step_stock_orbax_wrote_restores_with_a_warning(steps, tmp_path, caplog):
  ctl, _, _ = steps
  directory = tmp_path / "stock"
  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(saved(1)))
    mngr.wait_until_finished()
  with ctl.checkpointer(directory) as ckpt, caplog.at_level(logging.WARNING):
    back = ckpt.restore(1, target())
  np.testing.assert_array_equal(back["w"], saved(1)["w"])
  assert "was written by stock Orbax (it has no sidecar_manifest.json): it has no checksums" \
      in caplog.text


def test_stock_orbax_still_restores_a_step_the_sidecar_wrote(steps):
  """The manifest's key in _METADATA is one stock Orbax reads past."""
  _, _, directory = steps
  with ocp.CheckpointManager(directory) as mngr:
    back = mngr.restore(2, args=ocp.args.StandardRestore(target()))
  np.testing.assert_array_equal(back["w"], saved(2)["w"])


def test_a_damaged_step_set_aside_after_fallback_is_saved_anew_and_kept_whole(steps):
  """Issue 79 item 1: restored past a damaged latest step (fallback=True), training went
  on and save(2) was refused ("step 2 is already saved"). set_aside(2) moves it out of
  the steps, kept as set-aside-2; its number is saved anew, restored, and stock Orbax
  lists the directory's steps as the checkpointer does."""
  ctl, ckpt, directory = steps
  _flip(directory / "2" / "default" / "w" / "0")  # a chunk fails its crc32c
  ckpt.drop_ram_tier()  # from storage
  ckpt.restore(target=target(), fallback=True)
  assert ckpt.restored_step == 1 and ckpt.latest_step() == 2  # the user decides
  with pytest.raises(sidecar.InvalidArgumentError, match="step 2 is already saved"):
    ckpt.save(2, saved(2))
  moved = ckpt.set_aside(2)
  assert moved == str(directory / "set-aside-2") and ckpt.all_steps() == [1]
  assert (directory / "set-aside-2" / "default").is_dir()  # kept whole, for the user
  ckpt.save(2, saved(3)).durable.result(60)
  assert ckpt.all_steps() == [1, 2]
  with pytest.raises(sidecar.InvalidArgumentError, match="step 5 is not a committed step"):
    ckpt.set_aside(5)
  with ctl.checkpointer(directory) as again:  # a new job lists the new step 2, not the old
    assert again.all_steps() == [1, 2]
    again.drop_ram_tier()
    np.testing.assert_array_equal(again.restore(2, target())["w"], saved(3)["w"])
  with ocp.CheckpointManager(directory) as mngr:
    assert list(mngr.all_steps()) == [1, 2]
