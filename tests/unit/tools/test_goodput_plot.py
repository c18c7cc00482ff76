"""``sidecar goodput --plot``: the timeline's spans and labels, from a ledger written here."""

import json

import pytest

import sidecar
from sidecar._src.core import accounting, goodput
from sidecar._src.core.goodput import Counters, Event
from sidecar._src.tools import cli, goodput_cli

pytestmark = pytest.mark.unit

# Life a: from scratch at 0, restores nothing, first step at 10, saves step 10 at 20
# (blocked 1 s), dies at 30. Life b: starts at 32, restores step 10 (2 s, up to 36),
# first step at 40, rolls back in-process to step 10 at 45, finishes at 50.
EVENTS = [
    Event("start", "a", 0.1, Counters(), start=0.0, pid=1),
    Event("first_step", "a", 10.0, Counters(2, 0.5, 0.0, 0.0)),
    Event("save", "a", 20.0, Counters(12, 0.5, 1.0, 0.0), step=10),
    Event("mark", "a", 30.0, Counters(22, 0.5, 1.0, 0.0)),
    Event("died", "a", 30.0, seen=30.0),
    Event("start", "b", 32.1, Counters(), start=32.0, pid=2),
    Event("restore", "b", 36.0, Counters(0, 0.0, 0.0, 2.0), step=10),
    Event("first_step", "b", 40.0, Counters(2, 0.0, 0.0, 2.0)),
    Event("restore", "b", 45.0, Counters(6, 0.0, 0.0, 2.5), step=10),
    Event("finish", "b", 50.0, Counters(11, 0.0, 0.0, 2.5)),
]


def write(directory):
  (directory / goodput.FILE).write_bytes(b"".join(e.line() for e in EVENTS))


def test_each_life_is_labelled_with_the_step_it_resumed_from():
  ledger = accounting.account(EVENTS)
  assert [goodput_cli.life_label(i, x) for i, x in enumerate(ledger.lives)] == [
      "life 0: from scratch", "life 1: resumed from step 10; rolled back to 10"]


def test_the_timeline_draws_data_wait_checkpoint_and_restore_in_their_lives():
  bars = goodput_cli.bars(accounting.account(EVENTS))
  spans = {(b.row, b.category): [] for b in bars}
  for b in bars:
    spans[(b.row, b.category)].append((b.start, b.end))
  assert spans[(0, "startup")] == [(0.0, 10.0)]
  assert spans[(0, "productive")] == [(10.0, 20.0)]
  assert spans[(0, "redone")] == [(20.0, 30.0)]  # life b resumed from the save at 20
  assert spans[(0, "data_wait")] == [(9.5, 10.0)]
  assert spans[(0, "checkpoint")] == [(19.0, 20.0)]
  assert spans[(0, "restart_gap")] == [(30.0, 32.0)]
  assert spans[(1, "restore")] == [(34.0, 36.0), (44.5, 45.0)]  # the resume, the rollback
  assert spans[(1, "redone")] == [(40.0, 45.0)]  # rolled back to the step it resumed from
  assert {b.category for b in bars} == {"startup", "productive", "redone", "data_wait",
                                        "checkpoint", "restore", "restart_gap"}
  assert all(b.category in goodput_cli.COLORS for b in bars)


def test_the_title_says_the_time_between_runs_the_axis_shows_and_the_wall_leaves_out():
  """Issue 79 item 5: the title said 102 s where the axis ran to ~122 s: a run that
  finished, then the same job run on later; the wall time leaves the time between out."""
  assert goodput_cli.title(accounting.account(EVENTS)) == "goodput " + (
      f"{100 * accounting.account(EVENTS).goodput:.1f}% of 50.0 s, 1 restart")
  later = [*EVENTS,
           Event("start", "c", 70.1, Counters(), start=70.0, pid=3),
           Event("first_step", "c", 72.0, Counters(2, 0.0, 0.0, 0.0)),
           Event("finish", "c", 80.0, Counters(10, 0.0, 0.0, 0.0))]
  ledger = accounting.account(later)
  assert ledger.wall_s == pytest.approx(60.0)  # 0..50, then 70..80
  assert goodput_cli.title(ledger).endswith(
      "% of 60.0 s, 1 restart; the axis runs 80.0 s: 20.0 s between runs, nothing running, "
      "are not counted")


def test_the_command_says_where_it_drew_and_keeps_stdout_for_the_json(
    tmp_path, capsys, monkeypatch):
  pytest.importorskip("matplotlib")
  write(tmp_path)
  monkeypatch.chdir(tmp_path)  # a relative --plot: the line names the whole path
  assert cli.main(["goodput", str(tmp_path), "--json", "--plot", "timeline.png"]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["restarts"] == 1
  assert f"drew the timeline to {tmp_path / 'timeline.png'}" in err
  assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("where,why", [
    ("missing/timeline.png", "No such file or directory"),
    ("made/", "Is a directory"),
    ("timeline.xyz", "Format 'xyz' is not supported"),
], ids=["no-such-directory", "a-directory", "no-such-format"])
def test_a_plot_it_cannot_write_is_one_line_naming_the_path_and_why(
    tmp_path, capsys, monkeypatch, where, why):
  # Issue 71 item 4: a raw matplotlib traceback, before.
  pytest.importorskip("matplotlib")
  write(tmp_path)
  monkeypatch.chdir(tmp_path)
  if where.endswith("/"):  # a directory named like the plot
    where = "timeline.png"
    (tmp_path / where).mkdir()
  assert cli.main(["goodput", str(tmp_path), "--plot", where]) == 1
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1, err
  assert err.startswith(f"sidecar goodput: cannot draw the timeline to "
                        f"{str(tmp_path / where)!r}: {why}"), err
  assert "--plot names a .png file in a directory that exists" in err


def test_plot_raises_its_typed_error_for_a_path_it_cannot_write(tmp_path):
  pytest.importorskip("matplotlib")
  ledger = accounting.account(EVENTS)
  with pytest.raises(sidecar.InvalidArgumentError, match="No such file or directory") as info:
    goodput_cli.plot(ledger, str(tmp_path / "missing" / "t.png"))
  assert isinstance(info.value.__cause__, OSError)
