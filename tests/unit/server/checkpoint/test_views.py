"""A step's one vocabulary: every (phase, takeover) projects to each outside view through
``step.VIEWS`` (what this host tells the committer, the Status lists, the RAM tier's reason
to keep it, ``sidecar drain``'s word), and a real step driven to a pair reads that row.

No server, no processes: steps as the sidecar's stage, writer and agreement drive them.
"""

import numpy as np
import pytest

from sidecar._src.ckptfmt.records import AgreePhase, ShardId
from sidecar._src.server.checkpoint import step as step_lib
from sidecar._src.server.checkpoint.step import VIEWS, Phase, Step, Takeover, View
from sidecar._src.tools import drain
from tests.support.ram_steps import make_step

pytestmark = pytest.mark.unit

D = "/ck/run"
FINAL = f"{D}/1/default"
T, W, F = AgreePhase.TAKEN_OVER, AgreePhase.WRITTEN, AgreePhase.FAILED
BEING, WAITING, FAILED, DURABLE = ("being written", "waiting for its commit",
                                   "its save failed", "durable")
NOT_TAKEN = (Takeover.NONE, Takeover.ENDED)  # an agreement that ended reads as none

# (phase, takeovers) -> (agree, Status lists, RAM tier's reason, drain's word)
EXPECTED = {
    (Phase.STAGING, NOT_TAKEN): (T, ("writing",), BEING, "writing"),
    (Phase.STAGING, (Takeover.PENDING,)): (T, ("committing", "writing"), BEING, "writing"),
    (Phase.STAGED, NOT_TAKEN): (T, ("writing",), BEING, "writing"),
    (Phase.STAGED, (Takeover.PENDING,)): (T, ("committing", "writing"), BEING, "writing"),
    (Phase.WRITTEN, NOT_TAKEN): (W, ("uncommitted",), WAITING, "uncommitted"),
    (Phase.WRITTEN, (Takeover.PENDING,)): (W, ("committing",), WAITING, "writing"),
    (Phase.FAILED, NOT_TAKEN): (F, ("uncommitted",), FAILED, "uncommitted"),
    (Phase.FAILED, (Takeover.PENDING,)): (F, ("committing",), FAILED, "writing"),
    (Phase.COMMITTED, NOT_TAKEN): (W, ("ram_steps",), DURABLE, "committed"),
    (Phase.COMMITTED, (Takeover.PENDING,)): (W, ("committing", "ram_steps"), DURABLE,
                                             "writing"),
    (Phase.DROPPED, tuple(Takeover)): (None, (), BEING, ""),
}
PAIRS = [(phase, takeover, row) for (phase, takeovers), row in EXPECTED.items()
         for takeover in takeovers]


def test_the_table_holds_every_pair_once():
  assert sorted(VIEWS, key=str) == sorted(((p, t) for p in Phase for t in Takeover), key=str)
  assert len(PAIRS) == len(VIEWS) == len(Phase) * len(Takeover)


@pytest.mark.parametrize(("phase", "takeover", "row"), PAIRS,
                         ids=[f"{p.name}-{t.name}" for p, t, _ in PAIRS])
def test_each_pair_maps_to_each_view(phase, takeover, row):
  agree, lists, copy, word = row
  view = VIEWS[(phase, takeover)]
  assert (view.agree, view.lists, view.copy, view.drain) == row
  assert view.in_flight == (word == drain.WRITING)  # a stop waits, an open keeps its files
  assert view.writing == ("writing" in lists)  # its bytes count as being written
  assert view.uncommitted == ("uncommitted" in lists)  # it expires
  assert view.saving == (copy not in (DURABLE, FAILED))  # a tenant's save in progress
  if lists:  # what drain reads back from a sidecar's Status lists
    assert step_lib.drain_of(frozenset(lists)) == word


def test_drain_speaks_the_table_s_words():
  assert (drain.WRITING, drain.UNCOMMITTED, drain.COMMITTED) == (
      step_lib.WRITING, step_lib.UNCOMMITTED, step_lib.COMMITTED)
  words = {v.drain for v in VIEWS.values()} - {""}
  assert words == {drain.WRITING, drain.UNCOMMITTED, drain.COMMITTED}


def shard():
  return {ShardId(("w",), ((0, 4),)): np.zeros(4, np.float32)}


def driven(phase: Phase, takeover: Takeover) -> Step:
  """A real step brought to ``phase`` with ``takeover``, by its transitions."""
  staged = phase is not Phase.STAGING
  written = phase in (Phase.WRITTEN, Phase.COMMITTED)
  own = make_step(D, 1, FINAL, shard(), written=written, staged=staged)
  if takeover is not Takeover.NONE:
    own.take_over()
  if phase is Phase.FAILED:
    own.end_write(error=OSError(28, "No space left on device"))
  if phase is Phase.COMMITTED:
    own.commit()
  if takeover is Takeover.ENDED:
    own.end_agreement()
  return own


REACHABLE = [(p, t) for p in (Phase.STAGED, Phase.WRITTEN, Phase.FAILED, Phase.COMMITTED)
             for t in Takeover] + [(Phase.STAGING, Takeover.NONE)]


@pytest.mark.parametrize(("phase", "takeover"), REACHABLE,
                         ids=[f"{p.name}-{t.name}" for p, t in REACHABLE])
def test_a_step_driven_to_a_pair_reads_its_row(phase, takeover):
  own = driven(phase, takeover)
  assert (own.phase, own.takeover) == (phase, takeover)
  assert own.view() == VIEWS[(phase, takeover)]
  own.drop()


@pytest.mark.parametrize(("end", "agree"), [
    (None, AgreePhase.TAKEN_OVER), ("written", AgreePhase.WRITTEN),
    ("failed", AgreePhase.FAILED)], ids=["mid-write", "written", "failed"])
def test_a_dropped_step_tells_the_committer_its_write_s_end(end, agree):
  """Dropped (aborted, replaced) while taken over: no list names it, and what it tells the
  committer is how its write ended, kept through the drop."""
  own = make_step(D, 1, FINAL, shard(), written=False)
  own.take_over()
  own.drop()
  if end == "written":
    own.end_write([])
  elif end == "failed":
    own.end_write(error=OSError(5, "Input/output error"))
  view = own.view()
  assert own.phase is Phase.DROPPED and own.takeover is Takeover.PENDING
  assert view == View(agree, (), BEING, "")


def test_outside_code_has_no_flag_to_read():
  """The phase and the takeover are the step's state outside step.py: the flags that
  restated them are gone."""
  assert not [name for name in ("write_ended", "commit_pending", "taken_over", "whole")
              if hasattr(Step, name)]
