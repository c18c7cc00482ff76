"""Which lines of a sidecar's log ``sidecar launch`` shows (tools/sidecar_logs.py), where each
run keeps them, and the thread that follows the files; the launch itself shows them in
tests/processes/tools/test_launch_logs.py."""

import json
import os

import pytest

from sidecar._src.core import errors
from sidecar._src.tools import sidecar_logs

pytestmark = pytest.mark.unit

LOG = b"""\
sidecar host 0 serving on unix:/tmp/x/host0.grpc (health on the same socket)
2026-12-01 11:42:07,123 INFO sidecar._src.server.workers.workers: worker pid 7 attached
2026-12-01 11:42:08,001 WARNING sidecar._src.server.checkpoint.ram_tier: step 3 was never committed
2026-12-01 11:42:09,002 ERROR sidecar._src.server.checkpoint.save: step 4: writing failed: ENOSPC
Traceback (most recent call last):
  File "save.py", line 1, in _write
OSError: [Errno 28] No space left on device
2026-12-01 11:42:10,003 INFO sidecar._src.server.checkpoint.save: step 5: wrote 1 KiB
Exception in thread sidecar-x:
Traceback (most recent call last):
ValueError: boom
2026-12-01 11:42:11,004 DEBUG sidecar: quiet
"""
SHOWN = [
    "2026-12-01 11:42:08,001 WARNING sidecar._src.server.checkpoint.ram_tier: step 3 was never "
    "committed",
    "2026-12-01 11:42:09,002 ERROR sidecar._src.server.checkpoint.save: step 4: writing failed: "
    "ENOSPC",
    "Traceback (most recent call last):",
    '  File "save.py", line 1, in _write',
    "OSError: [Errno 28] No space left on device",
    "Exception in thread sidecar-x:",
    "Traceback (most recent call last):",
    "ValueError: boom",
]


@pytest.mark.parametrize("size", [1, 7, 1 << 20], ids=["bytes", "pieces", "whole"])
def test_warnings_errors_and_their_tracebacks_are_shown_in_pieces_of_any_size(size):
  lines = sidecar_logs.Lines()
  shown = []
  for i in range(0, len(LOG), size):
    shown += lines.feed(LOG[i:i + size])
  assert shown + lines.end() == SHOWN


def test_a_partial_last_line_waits_for_its_end_or_the_logs():
  lines = sidecar_logs.Lines()
  assert lines.feed(b"2026-12-01 11:42:08,001 ERROR x: half") == []
  assert lines.feed(b" a line") == []
  assert lines.end() == ["2026-12-01 11:42:08,001 ERROR x: half a line"]
  assert lines.end() == []


def test_json_records_are_shown_by_their_level():
  lines = [json.dumps({"time": "t", "level": level, "logger": "sidecar", "message": "m"})
           for level in ("INFO", "WARNING", "DEBUG")]
  lines += ["{not json: part of the DEBUG record}", json.dumps({"level": "CRITICAL"})]
  shown = sidecar_logs.Lines().feed("\n".join(lines).encode() + b"\n")
  assert [json.loads(line)["level"] for line in shown] == ["WARNING", "CRITICAL"]


def test_each_run_gets_a_directory_of_its_own_in_the_base(tmp_path):
  base = tmp_path / "a" / "b"
  first, second = sidecar_logs.run_dir(str(base)), sidecar_logs.run_dir(str(base))
  assert first != second and os.path.dirname(first) == os.path.dirname(second) == str(base)
  assert oct(os.stat(first).st_mode & 0o777) == "0o700"
  assert os.path.basename(second).startswith(os.path.basename(first))  # same second, same pid


def test_a_base_that_cannot_be_a_directory_is_refused_naming_it_and_the_fix(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(errors.InvalidArgumentError, match=r"cannot keep the sidecars' logs in "
                     r"'.*file': .*; give --log-dir \(or \$SIDECAR_LOG_DIR\)"):
    sidecar_logs.run_dir(str(tmp_path / "file"))


def test_the_base_is_the_flag_else_the_environment_else_sidecar_logs(monkeypatch, tmp_path):
  monkeypatch.setenv("SIDECAR_LOG_DIR", str(tmp_path / "env"))
  assert sidecar_logs.base_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")
  assert sidecar_logs.base_dir(None) == str(tmp_path / "env")
  monkeypatch.delenv("SIDECAR_LOG_DIR")
  monkeypatch.chdir(tmp_path)
  assert sidecar_logs.base_dir(None) == str(tmp_path / "sidecar-logs")


def test_the_follower_shows_what_is_written_and_reads_a_removed_log_to_its_end(tmp_path):
  paths = {0: tmp_path / "host0.log", 1: tmp_path / "host1.log"}
  paths[0].write_bytes(b"2026-12-01 11:42:08,001 WARNING a: before the start\n")
  shown: list[str] = []
  follower = sidecar_logs.Follower({h: str(p) for h, p in paths.items()}, shown.append,
                                   interval=0.01).start()
  try:
    with open(paths[1], "ab") as f:  # made after the start: found on a later read
      f.write(b"2026-12-01 11:42:09,001 ERROR b: made later\n")
    with open(paths[0], "ab") as f:
      f.write(b"2026-12-01 11:42:10,001 ERROR a: then removed")
    os.remove(paths[0])
  finally:
    follower.close()
  assert sorted(shown) == [
      "[sidecar 0] 2026-12-01 11:42:08,001 WARNING a: before the start",
      "[sidecar 0] 2026-12-01 11:42:10,001 ERROR a: then removed",
      "[sidecar 1] 2026-12-01 11:42:09,001 ERROR b: made later",
  ]
  follower.close()  # idempotent
