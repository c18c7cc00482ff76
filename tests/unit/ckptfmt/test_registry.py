"""The format registry: formats by name, by their uncommitted and committed directories,
and what a sweep puts back (tests/processes/ckptfmt/test_no_orbax.py: DCP without Orbax)."""

import os
import pathlib
import re

import pytest

from sidecar._src.ckptfmt import records, registry as formats_lib
from sidecar._src.ckptfmt.dcp.format import DcpFormat
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.core import errors
from tests.support import races

pytestmark = pytest.mark.unit

# The registered formats as messages list them (a new format changes no test here).
NAMES = re.escape(repr(formats_lib.DEFAULT.names))


def test_the_registry_finds_formats_by_name_and_by_their_directories(tmp_path):
  formats = formats_lib.DEFAULT
  assert isinstance(formats.get("orbax"), OrbaxFormat)
  assert isinstance(formats.get("dcp"), DcpFormat)
  for other in ("x", "", "colocated-sidecar"):  # one name each: no empty or old spelling
    with pytest.raises(errors.InvalidArgumentError,
                       match=rf"format must be one of the registered formats {NAMES}, "
                       rf"got '{other}'"):
      formats.get(other)
  fmt, where = formats.of_tmp(tmp_path / "3.orbax-checkpoint-tmp" / "default")
  assert fmt.name == "orbax" and where.final == tmp_path / "3" / "default"
  fmt, where = formats.of_tmp(tmp_path / "ck.dcp-checkpoint-tmp")
  assert fmt.name == "dcp" and where.final == tmp_path / "ck"
  assert formats.of_tmp(tmp_path / "3" / "default") is None
  (tmp_path / "ck").mkdir()
  (tmp_path / "ck" / ".metadata").write_bytes(b"\x80")
  assert formats.of_committed(str(tmp_path / "ck")).name == "dcp"  # no manifest: its markers
  (tmp_path / "3" / "default").mkdir(parents=True)
  (tmp_path / "3" / "default" / "_METADATA").write_text("{}")  # stock Orbax's: no manifest
  assert formats.of_committed(str(tmp_path / "3" / "default")).name == "orbax"
  with pytest.raises(errors.InvalidArgumentError, match=r"/nothing is not a committed checkpoint: "
                     rf"it has no sidecar_manifest.json, and no format of {NAMES}"):
    formats.of_committed(str(tmp_path / "nothing"))


def test_a_format_says_where_a_save_stages_and_commits_from_begins_answer(tmp_path):
  formats = formats_lib.DEFAULT
  tmp = formats.get("orbax").create_tmp(str(tmp_path / "ck"), 3)
  assert formats.get("orbax").staged_dirs(str(tmp)) == (
      str(tmp_path / "ck" / "3.orbax-checkpoint-tmp" / "default"),
      str(tmp_path / "ck" / "3" / "default"))
  tmp = formats.get("dcp").create_tmp(str(tmp_path / "ck" / "4"), 4)
  assert formats.get("dcp").staged_dirs(str(tmp)) == (str(tmp), str(tmp_path / "ck" / "4"))
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"/ck/4' is not an uncommitted step directory of format 'dcp' "
                     r"\(\*.dcp-checkpoint-tmp\); pass the directory its Begin answered"):
    formats.get("dcp").staged_dirs(str(tmp_path / "ck" / "4"))


def test_a_steps_final_directory_is_made_of_the_path_as_given(tmp_path):
  """A trainer's final_dir: the client's spelling (through a symlink, relative), never the
  resolved one the sidecar's Begin answers."""
  formats = formats_lib.DEFAULT
  (tmp_path / "real").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "real")
  link = str(tmp_path / "link")
  assert formats.get("orbax").final_dir(link, 3) == f"{link}/3/default"
  assert formats.get("orbax").final_dir("ck", 3) == "ck/3/default"
  assert formats.get("dcp").final_dir(f"{link}/4", 4) == f"{link}/4"
  assert formats.get("dcp").final_dir("ck/4", 4) == "ck/4"


def _manifest(path: pathlib.Path, name: str) -> str:
  path.mkdir(parents=True, exist_ok=True)
  (path / records.MANIFEST_FILE).write_text(records.Manifest(name, (), ()).to_json())
  return str(path)


def test_a_committed_directorys_format_is_the_one_its_manifest_names(tmp_path):
  formats = formats_lib.DEFAULT
  # Its manifest, not its files, says: Orbax's markers beside a manifest naming DCP's.
  final = _manifest(tmp_path / "3" / "default", "dcp")
  (tmp_path / "3" / "default" / "_METADATA").write_text("{}")
  assert formats.of_committed(final).name == "dcp"
  _manifest(tmp_path / "3" / "default", "orbax")  # rewritten: read again
  assert formats.of_committed(final).name == "orbax"


def test_a_manifest_saved_with_the_old_orbax_spelling_reads_as_orbax(tmp_path):
  final = _manifest(tmp_path / "2" / "default", "colocated-sidecar")
  assert records.Manifest.from_json(
      (tmp_path / "2" / "default" / records.MANIFEST_FILE).read_bytes(), final).format == "orbax"
  assert formats_lib.DEFAULT.of_committed(final).name == "orbax"


def test_a_manifest_naming_an_unregistered_format_names_it_and_the_registered_ones(tmp_path):
  final = _manifest(tmp_path / "ck", "safetensors")
  with pytest.raises(errors.InvalidArgumentError,
                     match=r"/ck: its sidecar_manifest.json names format 'safetensors', which is "
                     rf"not one of this sidecar's registered formats {NAMES}"):
    formats_lib.DEFAULT.of_committed(final)


def test_a_sweep_puts_back_a_cut_overwrite_and_lists_the_uncommitted(tmp_path):
  from sidecar._src.ckptfmt.dcp import commit as dcp_commit, distcp
  (tmp_path / ("ck" + dcp_commit.OLD_SUFFIX)).mkdir()
  (tmp_path / ("ck" + dcp_commit.OLD_SUFFIX) / ".metadata").write_bytes(b"\x80")
  (tmp_path / ("other" + distcp.TMP_SUFFIX)).mkdir()
  (tmp_path / ("other" + distcp.TMP_SUFFIX) / dcp_commit.MADE_FILE).write_bytes(b"")  # a save's
  (tmp_path / ("planted" + distcp.TMP_SUFFIX)).mkdir()  # no save's: never listed to remove
  (tmp_path / "4.orbax-checkpoint-tmp").mkdir()
  assert DcpFormat().sweep(tmp_path) == [tmp_path / ("other" + distcp.TMP_SUFFIX)]
  assert (tmp_path / "ck" / ".metadata").is_file()  # the old copy is back at its path
  assert OrbaxFormat().sweep(tmp_path) == [tmp_path / "4.orbax-checkpoint-tmp"]
  assert pathlib.Path(tmp_path / ("other" + distcp.TMP_SUFFIX)).is_dir()  # the caller removes


@pytest.mark.parametrize("marker", ["_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt",
                                    "sidecar_manifest.json", "default/_METADATA",
                                    "default/sidecar_manifest.json"],
                         ids=["step-metadata", "item-metadata", "commit", "manifest",
                              "in-item", "manifest-in-item"])
def test_a_directory_with_a_checkpoint_marker_is_a_checkpoint(tmp_path, marker):
  (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
  (tmp_path / marker).write_text("{}")
  assert formats_lib.is_checkpoint(tmp_path)


def test_a_step_removed_while_it_is_looked_at_is_not_a_checkpoint(tmp_path, monkeypatch):
  """Another host's retention removes step 3 between the check that it is a directory and
  the listing of its items (seen beside a second suite: an Open failed with ENOENT)."""
  step = tmp_path / "3"
  (step / "default").mkdir(parents=True)
  (step / "default" / "_METADATA").write_text("{}")
  pending = races.removed_first(monkeypatch, pathlib.Path, "iterdir", step)
  assert not formats_lib.is_checkpoint(step)
  assert not pending  # the step went at the racy moment


@pytest.mark.parametrize("files,asked,listing", [
    (("default/_METADATA",), ".", (pathlib.Path, "iterdir")),
    ((".metadata", "__0_0.distcp"), "default", (os, "scandir"))],
    ids=["orbax-step-asked-by-dcp", "dcp-step-asked-by-orbax"])
def test_a_step_removed_while_a_reader_of_another_format_looks_is_gone_not_an_error(
    tmp_path, monkeypatch, files, asked, listing):
  """A restore names a step of another format's layout while another host's retention
  removes it, between the check that it is one and the listing of its files: not ENOENT
  (nor a step of another format), but what a step that is not there gets."""
  step = tmp_path / "3"
  for name in files:
    (step / name).parent.mkdir(parents=True, exist_ok=True)
    (step / name).write_text("{}")
  pending = races.removed_first(monkeypatch, *listing, step)
  final_dir = str(step / asked)
  formats_lib.DEFAULT.check_read(final_dir)  # nothing of another format there now
  assert not pending  # the step went at the racy moment
  with pytest.raises(errors.InvalidArgumentError, match=r"3\S* is not a committed checkpoint"):
    formats_lib.DEFAULT.of_committed(final_dir)


def test_other_directories_are_not_checkpoints(tmp_path):
  """Nothing deeper than an item counts, nor a marker that is a directory, nor an item
  that is a symlink to a checkpoint elsewhere (delete would remove what it points to)."""
  (tmp_path / "data" / "a" / "b").mkdir(parents=True)
  (tmp_path / "data" / "a" / "b" / "_METADATA").write_text("{}")
  (tmp_path / "data" / "_CHECKPOINT_METADATA" / "x").mkdir(parents=True)
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "elsewhere" / "_METADATA").write_text("{}")
  (tmp_path / "data" / "default").symlink_to(tmp_path / "elsewhere")
  (tmp_path / "data" / "notes.txt").write_text("not a checkpoint")
  assert not formats_lib.is_checkpoint(tmp_path / "data")


def test_a_formats_markers_and_scratch_directories_are_the_registrys_answers(tmp_path):
  formats = formats_lib.DEFAULT
  assert {".orbax-checkpoint-tmp", ".dcp-checkpoint-tmp", ".dcp-checkpoint-old"} <= set(
      formats.scratch_suffixes())
  (tmp_path / "item").mkdir()
  assert not formats.has_markers(tmp_path / "item")
  for marker in ("_METADATA", ".metadata", records.MANIFEST_FILE):  # Orbax's, DCP's, ours
    (tmp_path / marker).mkdir()  # a directory of that name marks nothing
    assert not formats.has_markers(tmp_path)
    (tmp_path / marker).rmdir()
    (tmp_path / marker).write_text("{}")
    assert formats.has_markers(tmp_path)
    (tmp_path / marker).unlink()
  (tmp_path / "step" / "default").mkdir(parents=True)
  (tmp_path / "step" / "default" / "_METADATA").write_text("{}")
  assert not formats.has_markers(tmp_path / "step")  # its item's, not its own
  assert formats.is_checkpoint(tmp_path / "step")



def test_the_registry_knows_every_formats_markers_once_and_finds_them(tmp_path):
  """has_markers is asked of each directory above a staged step at every Stage: the list
  is the registry's, made once (it was rebuilt at each call)."""
  default = formats_lib.DEFAULT
  every = [m for f in default.formats.values() for m in f.markers]
  assert list(default.markers) == list(dict.fromkeys(every))
  assert len(default.markers) == len(set(default.markers))
  assert not default.has_markers(tmp_path)
  for marker in default.markers:
    (tmp_path / marker).touch()
    assert default.has_markers(tmp_path)
    (tmp_path / marker).unlink()
  only = formats_lib.Registry({"orbax": OrbaxFormat()})
  assert only.markers == tuple(dict.fromkeys(OrbaxFormat().markers))
