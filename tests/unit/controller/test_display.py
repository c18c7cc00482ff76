"""What a Controller, a feed and a checkpointer show at a prompt and in a notebook."""

import io

import pytest

import sidecar
from sidecar._src.controller import display
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def test_host_rows_show_an_unreachable_host_and_each_tier():
  s = pb.StatusResponse(arena_size=1 << 20, arena_used=1 << 19, arena_blocks=3, workers=1,
                        feeds=[pb.FeedStatus(pipeline="ids", batches=10, uptime_s=2.0,
                                             trainer_wait_s=0.05)],
                        checkpoints=[pb.CheckpointStatus(directory="/c", ram_steps=[4],
                                                         writing=[5], written_bytes=10,
                                                         total_bytes=20)])
  rows = display.host_rows([(0, "a:1", s), (1, "b:2", sidecar.HostLostError("gone\nmore"))])
  assert rows[0][2] == "512.0 KiB / 1.0 MiB (50%), 3 blocks"
  assert rows[0][4] == "ids: 10 batches, 5.0/s, trainer wait 5.0 ms"
  assert rows[0][5] == "/c: RAM [4], writing [5] (10 B of 20 B)"
  assert rows[1][2] == "unreachable: gone"
  html = display.html_table(display.HOST_HEADER, [["<x>", "", "", "", "", ""]])
  assert "&lt;x&gt;" in html  # escaped


def test_a_checkpointer_shows_each_hosts_tiers_and_a_status_that_failed_as_a_row():
  s = pb.StatusResponse(checkpoints=[pb.CheckpointStatus(directory="/c", ram_steps=[4],
                                                         writing=[5], written_bytes=10,
                                                         total_bytes=20, writing_s=1e-8)])
  s.identity.host_id = 3
  text = display.tier_table(lambda: [s], "/c")
  row = text.splitlines()[1].split()
  assert row[:2] == ["3", "[4]"] and "[5]: 10 B of 20 B (1.00 GB/s)" in text

  def fails():
    raise sidecar.HostLostError("gone\nmore")
  assert "HostLostError: gone" in display.tier_table(fails, "/c", as_html=True)


def test_a_save_s_progress_sums_its_hosts_and_is_none_before_any_writes():
  def status(written, total, seconds, step=5, directory="/c"):
    return pb.StatusResponse(checkpoints=[pb.CheckpointStatus(
        directory=directory, writing=[step], written_bytes=written, total_bytes=total,
        writing_s=seconds)])
  both = [status(1 << 30, 2 << 30, 0.5), status(1 << 30, 2 << 30, 2.0),
          status(9 << 30, 9 << 30, 1.0, directory="/other")]
  assert display.save_progress(both, "/c", 5) == (  # the rate: over the slower host's time
      "saving step 5: 2.0 GiB of 4.0 GiB durable (1.07 GB/s)")
  assert display.save_progress(both, "/c", 6) is None


class _Tty(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_one_watch_loop_redraws_each_fetch_with_the_previous_and_the_seconds_since():
  # `sidecar status --watch` and `sidecar pool status --watch` both run it (issue 72).
  fetched = iter([1, 2, 3])
  seen = []

  def screen(now, previous, seconds):
    seen.append((now, previous, seconds >= 0))
    return f"screen {now}"
  out = _Tty()
  assert display.redraw("sidecar test", lambda: next(fetched), screen, interval=0.001,
                        out=out, refreshes=3) == 0
  assert seen == [(1, None, True), (2, 1, True), (3, 2, True)]
  screens = out.getvalue().split(display.CLEAR)[1:]
  assert len(screens) == 3 and all(s.startswith("sidecar test  ") for s in screens)
  assert screens[0].endswith("every 0.001 s  (Ctrl-C to stop)\n\nscreen 1\n\n")
  plain = io.StringIO()  # not a terminal: nothing cleared
  display.redraw("t", lambda: 0, lambda *a: "", interval=0.001, out=plain, refreshes=1)
  assert display.CLEAR not in plain.getvalue()
