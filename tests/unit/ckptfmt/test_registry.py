"""The format registry: formats by name, by their uncommitted and committed directories,
and what a sweep puts back (tests/processes/ckptfmt/test_no_orbax.py: DCP without Orbax)."""

import pathlib

import pytest

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.ckptfmt.dcp.format import DcpFormat
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.core import errors

pytestmark = pytest.mark.unit

def test_the_registry_finds_formats_by_name_and_by_their_directories(tmp_path):
  formats = formats_lib.DEFAULT
  assert isinstance(formats.get(""), OrbaxFormat) and isinstance(formats.get("dcp"), DcpFormat)
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"format must be one of \['dcp', 'orbax'\] \('' is 'orbax'\), got 'x'"):
    formats.get("x")
  fmt, where = formats.of_tmp(tmp_path / "3.orbax-checkpoint-tmp" / "default")
  assert fmt.name == "orbax" and where.final == tmp_path / "3" / "default"
  fmt, where = formats.of_tmp(tmp_path / "ck.dcp-checkpoint-tmp")
  assert fmt.name == "dcp" and where.final == tmp_path / "ck"
  assert formats.of_tmp(tmp_path / "3" / "default") is None
  (tmp_path / "ck").mkdir()
  (tmp_path / "ck" / ".metadata").write_bytes(b"\x80")
  assert formats.of_committed(str(tmp_path / "ck")).name == "dcp"
  assert formats.of_committed(str(tmp_path / "3" / "default")).name == "orbax"


def test_a_sweep_puts_back_a_cut_overwrite_and_lists_the_uncommitted(tmp_path):
  from sidecar._src.ckptfmt.dcp import distcp
  (tmp_path / ("ck" + distcp.OLD_SUFFIX)).mkdir()
  (tmp_path / ("ck" + distcp.OLD_SUFFIX) / ".metadata").write_bytes(b"\x80")
  (tmp_path / ("other" + distcp.TMP_SUFFIX)).mkdir()
  (tmp_path / ("other" + distcp.TMP_SUFFIX) / distcp.MADE_FILE).write_bytes(b"")  # a save's
  (tmp_path / ("planted" + distcp.TMP_SUFFIX)).mkdir()  # no save's: never listed to remove
  (tmp_path / "4.orbax-checkpoint-tmp").mkdir()
  assert DcpFormat().sweep(tmp_path) == [tmp_path / ("other" + distcp.TMP_SUFFIX)]
  assert (tmp_path / "ck" / ".metadata").is_file()  # the old copy is back at its path
  assert OrbaxFormat().sweep(tmp_path) == [tmp_path / "4.orbax-checkpoint-tmp"]
  assert pathlib.Path(tmp_path / ("other" + distcp.TMP_SUFFIX)).is_dir()  # the caller removes
