"""A step's one vocabulary: every (state, write's outcome, takeover) projects to each
outside view through ``lifecycle.VIEWS`` (what this host tells the committer, the Status
lists, the RAM tier's reason to keep it, ``sidecar drain``'s word), and a real step driven
to a key reads that row.

No server, no processes: steps as the sidecar's stage, writer and agreement drive them.
"""

import threading

import numpy as np
import pytest

from sidecar._src.ckptfmt.records import ShardId, Standing
from sidecar._src.server.checkpoint import lifecycle
from sidecar._src.server.checkpoint.lifecycle import VIEWS, Outcome, State, Takeover, View
from sidecar._src.server.checkpoint.step import Step
from sidecar._src.tools import drain
from tests.support.ram_steps import make_step

pytestmark = pytest.mark.unit

D = "/ck/run"
FINAL = f"{D}/1/default"
T, W, F = Standing.TAKEN_OVER, Standing.WRITTEN, Standing.FAILED
BEING, WAITING, FAILED, DURABLE = ("being written", "waiting for its commit",
                                   "its save failed", "durable")
N = Outcome.NONE

# (state, outcome, pending) -> (agree, Status lists, RAM tier's reason, drain's word)
EXPECTED = {
    (State.STAGING, N, False): (T, ("writing",), BEING, "writing"),
    (State.STAGING, N, True): (T, ("committing", "writing"), BEING, "writing"),
    (State.STAGED, N, False): (T, ("writing",), BEING, "writing"),
    (State.STAGED, N, True): (T, ("committing", "writing"), BEING, "writing"),
    (State.WRITTEN, Outcome.WRITTEN, False): (W, ("uncommitted",), WAITING, "uncommitted"),
    (State.WRITTEN, Outcome.WRITTEN, True): (W, ("committing",), WAITING, "writing"),
    (State.FAILED, Outcome.FAILED, False): (F, ("uncommitted",), FAILED, "uncommitted"),
    (State.FAILED, Outcome.FAILED, True): (F, ("committing",), FAILED, "writing"),
    (State.COMMITTED, Outcome.WRITTEN, False): (W, ("ram_steps",), DURABLE, "committed"),
    **{(State.DROPPED, outcome, pending): (agree, (), BEING, "")
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


def driven(state: State, takeover: Takeover) -> Step:
  """A real step brought to ``state`` with ``takeover``, by its transitions."""
  staged = state is not State.STAGING
  written = state in (State.WRITTEN, State.COMMITTED)
  own = make_step(D, 1, FINAL, shard(), written=written, staged=staged)
  ended = threading.Event()  # its agreement's end (agreement.Agreement.ended)
  if takeover is not Takeover.NONE:
    own.take_over(ended)
  if state is State.FAILED:
    own.end_write(error=OSError(28, "No space left on device"))
  if state is State.COMMITTED:
    own.commit()
  if takeover is Takeover.ENDED:
    ended.set()
  return own


OUTCOME = {State.STAGING: N, State.STAGED: N, State.WRITTEN: Outcome.WRITTEN,
           State.FAILED: Outcome.FAILED, State.COMMITTED: Outcome.WRITTEN}
REACHABLE = [(p, t) for p in (State.STAGED, State.WRITTEN, State.FAILED) for t in Takeover]
REACHABLE += [(State.STAGING, Takeover.NONE), (State.COMMITTED, Takeover.NONE),
              (State.COMMITTED, Takeover.ENDED)]


@pytest.mark.parametrize(("state", "takeover"), REACHABLE,
                         ids=[f"{p.name}-{t.name}" for p, t in REACHABLE])
def test_a_step_driven_to_a_key_reads_its_row(state, takeover):
  own = driven(state, takeover)
  assert (own.state, own.takeover) == (state, takeover)
  assert own.view() == VIEWS[(state, OUTCOME[state], takeover is Takeover.PENDING)]
  own.drop()


def test_a_committed_step_is_never_pending():
  """Its commit ends its takeover in the same transition: no committed, pending row."""
  own = driven(State.COMMITTED, Takeover.PENDING)
  assert own.takeover is Takeover.ENDED and own.view() == VIEWS[
      (State.COMMITTED, Outcome.WRITTEN, False)]
  own.drop()


@pytest.mark.parametrize(("end", "agree"), [
    (None, Standing.TAKEN_OVER), ("written", Standing.WRITTEN),
    ("failed", Standing.FAILED)], ids=["mid-write", "written", "failed"])
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
  assert own.state is State.DROPPED and own.takeover is Takeover.PENDING
  assert view == View(agree, (), lifecycle.Reason.BEING_WRITTEN, lifecycle.Word.NONE)


def test_outside_code_has_no_flag_to_read():
  """The state and the takeover are all outside step.py reads of a step: the flags that
  restated them are gone."""
  assert not [name for name in ("write_ended", "commit_pending", "taken_over", "whole")
              if hasattr(Step, name)]
