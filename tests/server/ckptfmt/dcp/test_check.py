"""Tier 2: a restore returns the saved values or an error (issue 62 item 4), in DCP's
layout, through ``sidecar.torch.Checkpointer`` against an in-process sidecar.

What a DCP restore through the sidecars reads is the manifest's plan (where each item
lies) and the rank files; stock DCP reads ``.metadata``. Each is changed after the save:
``.metadata`` (a byte flipped), a rank file (truncated), the manifest (edited; removed
with an item's byte flipped). From storage each is refused naming the file and the older
intact step, and ``fallback=True`` restores that one; from the RAM tier (which keeps the
manifest the commit shared, and the bytes) the saved values come back. A state dict
entry of another dtype than saved is refused, not cast. A checkpoint stock DCP wrote (no
manifest, ever) restores with a warning that it has no checksums.
"""

import logging
import pathlib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import sidecar
import sidecar.torch

pytestmark = [pytest.mark.server,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def saved(step: int) -> dict:
  return {"w": torch.arange(4096, dtype=torch.float32) + (step - 2),
          "b": torch.full((3,), step, dtype=torch.int64)}


def target() -> dict:
  return {"w": torch.zeros(4096), "b": torch.zeros(3, dtype=torch.int64)}


def _flip(path: pathlib.Path, at: int | None = None) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2 if at is None else at] ^= 0xFF
  path.write_bytes(bytes(data))


def _no_manifest_and_a_flip(step: pathlib.Path) -> None:
  (step / "sidecar_manifest.json").unlink()
  _flip(step / "__0_0.distcp", (step / "__0_0.distcp").read_bytes().find(
      saved(2)["w"][2000:2001].numpy().tobytes()))


def _edit_manifest(step: pathlib.Path) -> None:
  path = step / "sidecar_manifest.json"
  path.write_text(path.read_text().replace('"dtype":"float32"', '"dtype":"int32"'))


def _truncate(step: pathlib.Path) -> None:
  path = step / "__0_0.distcp"
  path.write_bytes(path.read_bytes()[:-4096])


CORRUPTIONS = {
    ".metadata": (lambda step: _flip(step / ".metadata"),
                  r"ck: 2/\.metadata does not match the crc32c its save wrote"),
    "rank file truncated": (_truncate, r"ck: 2/__0_0\.distcp holds \d+ bytes, where its items "
                            r"end at byte \d+"),
    "manifest removed, a byte flipped": (
        _no_manifest_and_a_flip, r"sidecar_manifest\.json is missing, but its \.metadata says "
        r"a sidecar wrote it"),
    "manifest edited": (_edit_manifest, r"sidecar_manifest\.json does not match the crc32c "
                        "it was written with"),
}


@pytest.fixture
def steps(make_server, tmp_path):
  """A controller and a DCP checkpointer of ``tmp_path/ck`` with steps 1 and 2 durable."""
  server = make_server(shm_size=16 << 20)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=30) as ctl:
    with sidecar.torch.Checkpointer(tmp_path / "ck", controller=ctl) as ckpt:
      for step in (1, 2):
        ckpt.save(step, saved(step)).durable.result(60)
      ckpt.wait()
      yield ctl, ckpt, tmp_path / "ck"


def _clean(error: BaseException) -> str:
  text = str(error)
  assert "/proc/self/fd" not in text and "builtins." not in text, text
  return text


def _same(a: dict, b: dict) -> None:
  for k in b:
    assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_step_changed_on_disk_is_refused_named_and_skipped_by_fallback(steps, name):
  ctl, ckpt, directory = steps
  change, names = CORRUPTIONS[name]
  change(directory / "2")
  ckpt.drop_ram_tier()  # from storage
  with pytest.raises(sidecar.CorruptCheckpointError, match=names) as refused:
    ckpt.restore(2, target())
  assert "older committed steps that check intact: [1]" in _clean(refused.value)
  back = ckpt.restore(target=target(), fallback=True)
  assert ckpt.restored_step == 1 and ckpt.latest_step() == 2
  _same(back, saved(1))


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_from_the_ram_tier_the_saved_values(steps, name):
  ctl, ckpt, directory = steps
  CORRUPTIONS[name][0](directory / "2")
  _same(ckpt.restore(2, target()), saved(2))


def test_an_entry_of_another_dtype_is_refused_not_cast(steps):
  ctl, ckpt, directory = steps
  ckpt.drop_ram_tier()
  wrong = {"w": torch.zeros(4096, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.int64)}
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"state dict entry 'w' is torch.float64, but the step saved "
                           r"torch.float32"):
    ckpt.restore(2, wrong)


def test_a_checkpoint_stock_dcp_wrote_restores_with_a_warning(steps, tmp_path, caplog):
  ctl, _, _ = steps
  path = tmp_path / "stock" / "1"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save(saved(1), storage_writer=dcp.FileSystemWriter(path))
  sd = target()
  reader = sidecar.torch.StorageReader(path, controller=ctl)
  with caplog.at_level(logging.WARNING), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.load(sd, storage_reader=reader)
  _same(sd, saved(1))
  assert "was written by stock DCP (it has no sidecar_manifest.json): it has no checksums" \
      in caplog.text


def test_stock_dcp_still_loads_a_step_the_sidecar_wrote(steps):
  """The sidecar's save id in .metadata is a plain string to DCP."""
  _, _, directory = steps
  sd = target()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.load(sd, storage_reader=dcp.FileSystemReader(directory / "2"))
  _same(sd, saved(2))
