"""A step's one vocabulary: every (phase, write's outcome, takeover) projects to each
outside view through ``lifecycle.VIEWS`` (what this host tells the committer, the Status
lists, the RAM tier's reason to keep it, ``sidecar drain``'s word), and a real step driven
to a key reads that row.

No server, no processes: steps as the sidecar's stage, writer and agreement drive them.
"""

import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.records import AgreePhase, ShardId
from sidecar._src.server.checkpoint import lifecycle
from sidecar._src.server.checkpoint.lifecycle import VIEWS, Outcome, Phase, Takeover, View
from sidecar._src.server.checkpoint.step import Step
from sidecar._src.tools import drain
from tests.support.ram_steps import make_step

pytestmark = pytest.mark.unit

D = "/ck/run"
FINAL = f"{D}/1/default"
T, W, F = AgreePhase.TAKEN_OVER, AgreePhase.WRITTEN, AgreePhase.FAILED
BEING, WAITING, FAILED, DURABLE = ("being written", "waiting for its commit",
                                   "its save failed", "durable")
N = Outcome.NONE

# (phase, outcome, pending) -> (agree, Status lists, RAM tier's reason, drain's word)
EXPECTED = {
    (Phase.STAGING, N, False): (T, ("writing",), BEING, "writing"),
    (Phase.STAGING, N, True): (T, ("committing", "writing"), BEING, "writing"),
    (Phase.STAGED, N, False): (T, ("writing",), BEING, "writing"),
    (Phase.STAGED, N, True): (T, ("committing", "writing"), BEING, "writing"),
    (Phase.WRITTEN, Outcome.WRITTEN, False): (W, ("uncommitted",), WAITING, "uncommitted"),
    (Phase.WRITTEN, Outcome.WRITTEN, True): (W, ("committing",), WAITING, "writing"),
    (Phase.FAILED, Outcome.FAILED, False): (F, ("uncommitted",), FAILED, "uncommitted"),
    (Phase.FAILED, Outcome.FAILED, True): (F, ("committing",), FAILED, "writing"),
    (Phase.COMMITTED, Outcome.WRITTEN, False): (W, ("ram_steps",), DURABLE, "committed"),
    **{(Phase.DROPPED, outcome, pending): (agree, (), BEING, "")
       for outcome, agree in ((N, T), (Outcome.WRITTEN, W), (Outcome.FAILED, F))
       for pending in (False, True)},
}
KEYS = list(EXPECTED)


def test_the_table_holds_every_reachable_key_once():
  assert set(VIEWS) == set(EXPECTED)


@pytest.mark.parametrize("key", KEYS, ids=[f"{p.name}-{o.name}-{t}" for p, o, t in KEYS])
def test_each_key_maps_to_each_view(key):
  agree, lists, copy, word = EXPECTED[key]
  view = VIEWS[key]
  assert (view.agree, view.lists, view.copy, view.drain) == (agree, lists, copy, word)
  assert view.in_flight == (word == drain.WRITING)  # a stop waits, an open keeps its files
  assert view.writing == ("writing" in lists)  # its bytes count as being written
  assert view.uncommitted == ("uncommitted" in lists)  # it expires
  assert view.saving == (copy in (BEING, WAITING))  # a tenant's save in progress
  assert view.awaits_commit == (copy == WAITING)  # its commit is still to come
  assert view.written == (agree is W)  # its write ended with its records
  if lists:  # what drain reads back from a sidecar's Status lists
    assert lifecycle.drain_of(frozenset(lists)) == word


def test_drain_speaks_the_table_s_words():
  assert (drain.WRITING, drain.UNCOMMITTED, drain.COMMITTED) == (
      "writing", "uncommitted", "committed")
  words = {v.drain for v in VIEWS.values()} - {lifecycle.Word.NONE}
  assert words == {drain.WRITING, drain.UNCOMMITTED, drain.COMMITTED}
  # a sidecar of the release before listed a committed step pending in both lists
  assert lifecycle.drain_of(frozenset({"committing", "ram_steps"})) == drain.WRITING


def shard():
  return {ShardId(("w",), ((0, 4),)): np.zeros(4, np.float32)}


def driven(phase: Phase, takeover: Takeover) -> Step:
  """A real step brought to ``phase`` with ``takeover``, by its transitions."""
  staged = phase is not Phase.STAGING
  written = phase in (Phase.WRITTEN, Phase.COMMITTED)
  own = make_step(D, 1, FINAL, shard(), written=written, staged=staged)
  ended = threading.Event()  # its agreement's end (agreement.Agreement.ended)
  if takeover is not Takeover.NONE:
    own.take_over(ended)
  if phase is Phase.FAILED:
    own.end_write(error=OSError(28, "No space left on device"))
  if phase is Phase.COMMITTED:
    own.commit()
  if takeover is Takeover.ENDED:
    ended.set()
  return own


OUTCOME = {Phase.STAGING: N, Phase.STAGED: N, Phase.WRITTEN: Outcome.WRITTEN,
           Phase.FAILED: Outcome.FAILED, Phase.COMMITTED: Outcome.WRITTEN}
REACHABLE = [(p, t) for p in (Phase.STAGED, Phase.WRITTEN, Phase.FAILED) for t in Takeover]
REACHABLE += [(Phase.STAGING, Takeover.NONE), (Phase.COMMITTED, Takeover.NONE),
              (Phase.COMMITTED, Takeover.ENDED)]


@pytest.mark.parametrize(("phase", "takeover"), REACHABLE,
                         ids=[f"{p.name}-{t.name}" for p, t in REACHABLE])
def test_a_step_driven_to_a_key_reads_its_row(phase, takeover):
  own = driven(phase, takeover)
  assert (own.phase, own.takeover) == (phase, takeover)
  assert own.view() == VIEWS[(phase, OUTCOME[phase], takeover is Takeover.PENDING)]
  own.drop()


def test_a_committed_step_is_never_pending():
  """Its commit ends its takeover in the same transition: no committed, pending row."""
  own = driven(Phase.COMMITTED, Takeover.PENDING)
  assert own.takeover is Takeover.ENDED and own.view() == VIEWS[
      (Phase.COMMITTED, Outcome.WRITTEN, False)]
  own.drop()


@pytest.mark.parametrize(("end", "agree"), [
    (None, AgreePhase.TAKEN_OVER), ("written", AgreePhase.WRITTEN),
    ("failed", AgreePhase.FAILED)], ids=["mid-write", "written", "failed"])
def test_a_dropped_step_tells_the_committer_its_write_s_end(end, agree):
  """Dropped (aborted, replaced) while taken over: no list names it, and what it tells the
  committer is how its write ended, kept through the drop (its key's outcome)."""
  own = make_step(D, 1, FINAL, shard(), written=False)
  own.take_over(threading.Event())
  own.drop()
  if end == "written":
    own.end_write([])
  elif end == "failed":
    own.end_write(error=OSError(5, "Input/output error"))
  view = own.view()
  assert own.phase is Phase.DROPPED and own.takeover is Takeover.PENDING
  assert view == View(agree, (), lifecycle.Reason.BEING_WRITTEN, lifecycle.Word.NONE)


def test_outside_code_has_no_flag_to_read():
  """The phase and the takeover are the step's state outside step.py: the flags that
  restated them are gone."""
  assert not [name for name in ("write_ended", "commit_pending", "taken_over", "whole")
              if hasattr(Step, name)]
