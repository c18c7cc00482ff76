"""A step's lifecycle table: where a ``step.Step`` is, and how each reader outside sees it.

A step's place in its lifecycle is three values, each changed only by its transitions
(``step.py``): its :class:`State`, its :class:`Outcome` (how its write ended, kept through
a drop) and its :class:`Takeover` (whether the sidecars took it over). :data:`VIEWS`
projects each reachable (state, outcome, taken over and pending) to every outside view of
it (:class:`View`: what this host tells the committer, the Status lists, the RAM tier's
reason to keep it, ``sidecar drain``'s word), and ``Step.view`` reads it; nothing outside
this table groups states::

    state     outcome  pending agree       Status lists         RAM tier's reason       drain
    STAGING   NONE     no      TAKEN_OVER  writing              being written           writing
    STAGING   NONE     yes     TAKEN_OVER  committing, writing  being written           writing
    STAGED    (as STAGING)
    WRITTEN   WRITTEN  no      WRITTEN     uncommitted          waiting for its commit  uncommitted
    WRITTEN   WRITTEN  yes     WRITTEN     committing           waiting for its commit  writing
    FAILED    FAILED   no      FAILED      uncommitted          its save failed         uncommitted
    FAILED    FAILED   yes     FAILED      committing           its save failed         writing
    COMMITTED WRITTEN  no      WRITTEN     ram_steps            durable                 committed
    DROPPED   NONE     any     TAKEN_OVER  -                    being written           -
    DROPPED   WRITTEN  any     WRITTEN     -                    being written           -
    DROPPED   FAILED   any     FAILED      -                    being written           -

ENDED reads as not pending. A committed step is never pending: its commit ends its
takeover (``Step.commit``), in the same transition. A dropped step is in no list (the RAM
tier holds it no more); what it tells the committer is its write's outcome, kept through
the drop.
"""

from __future__ import annotations

import dataclasses
import enum

from sidecar._src.ckptfmt.records import Standing


class State(enum.Enum):
  """Where a ``step.Step`` is (``step.py``'s docstring draws the transitions)."""
  STAGING = "staging"  # shards arrive; the writer writes them as they come
  STAGED = "staged"  # every writer sent its last part: no more shards come
  WRITTEN = "written"  # written in its tmp directory; waits for its commit
  FAILED = "failed"  # its write failed (or was stopped)
  COMMITTED = "committed"  # committed on storage: the RAM tier's copy is durable
  DROPPED = "dropped"  # gone from the RAM tier: its bytes went back


# The states in which a step holds every part of its bytes (all its writers' last parts
# came; not failed, not dropped): a step taken over is read from its RAM tier then.
WHOLE = frozenset({State.STAGED, State.WRITTEN, State.COMMITTED})


class Outcome(enum.Enum):
  """How a step's write ended (``Step.end_write``), beside its state; a drop keeps it."""
  NONE = "not ended"  # its write goes on (or never began)
  WRITTEN = "written"  # its records as written are kept
  FAILED = "failed"  # its error is kept


class Takeover(enum.Enum):
  """Whether the sidecars took a step over (``agreement.py``), beside its state."""
  NONE = "not taken over"  # its trainers commit it (or nobody does)
  PENDING = "taken over"  # the sidecars commit it; its end is not known here yet
  ENDED = "agreed"  # the sidecars committed or abandoned it, or it is committed here


class Listed(enum.StrEnum):
  """A Status list a step is in: its value is ``CheckpointStatus``'s field."""
  WRITING = "writing"
  UNCOMMITTED = "uncommitted"
  RAM = "ram_steps"
  COMMITTING = "committing"


class Word(enum.StrEnum):
  """What ``sidecar drain`` (tools/drain.py) calls a step a sidecar lists."""
  WRITING = "writing"
  UNCOMMITTED = "uncommitted"
  COMMITTED = "committed"
  NONE = ""  # no list names it


class Reason(enum.StrEnum):
  """Why the RAM tier keeps a copy (``ram_yield.Copy.state``): durable, or why not."""
  BEING_WRITTEN = "being written"
  WAITING = "waiting for its commit"
  FAILED = "its save failed"
  DURABLE = "durable"
  ON_ITS_WAY = "a replica on its way"  # a replica's, never a step's


@dataclasses.dataclass(frozen=True, slots=True)
class View:
  """A step in one row of :data:`VIEWS`, as each reader outside ``step.py`` sees it.

  Attributes:
    agree: what this host tells the committer of its part (``agreement.py``).
    lists: the Status lists it is in (``RamTier.status``).
    copy: why the RAM tier keeps it (``ram_yield``): durable, or why not.
    drain: what ``sidecar drain`` calls it (NONE where no list names it).
  """
  agree: Standing
  lists: tuple[Listed, ...]
  copy: Reason
  drain: Word

  @property
  def in_flight(self) -> bool:
    """Being written, or taken over with its end not known: a stop waits for it, an
    ``open`` keeps its directory, ``sidecar drain`` says "writing"."""
    return self.drain is Word.WRITING

  @property
  def writing(self) -> bool:
    """Its write goes on (Status's ``writing``): its bytes are counted as being written,
    and its save is in flight (no other session begins its step)."""
    return Listed.WRITING in self.lists

  @property
  def uncommitted(self) -> bool:
    """Written (or failed) and not committed, its end not awaited: it expires."""
    return Listed.UNCOMMITTED in self.lists

  @property
  def written(self) -> bool:
    """Its write ended with its records (waiting for its commit, committed, or dropped
    since)."""
    return self.agree is Standing.WRITTEN

  @property
  def awaits_commit(self) -> bool:
    """Written, its commit still to come (from its trainers, or the sidecars')."""
    return self.copy is Reason.WAITING

  @property
  def saving(self) -> bool:
    """A save in progress (staged, being written or waiting for its commit): counted
    against a pool tenant's saves."""
    return self.copy in (Reason.BEING_WRITTEN, Reason.WAITING)


# Every outside view of a step, by (state, outcome, pending): the one table.
_T, _W, _F = Standing.TAKEN_OVER, Standing.WRITTEN, Standing.FAILED
_LW, _LU, _LR, _LC = Listed.WRITING, Listed.UNCOMMITTED, Listed.RAM, Listed.COMMITTING
VIEWS = {
    **{(state, Outcome.NONE, pending): View(_T, (_LC, _LW) if pending else (_LW,),
                                            Reason.BEING_WRITTEN, Word.WRITING)
       for state in (State.STAGING, State.STAGED) for pending in (False, True)},
    (State.WRITTEN, Outcome.WRITTEN, False): View(_W, (_LU,), Reason.WAITING,
                                                  Word.UNCOMMITTED),
    (State.WRITTEN, Outcome.WRITTEN, True): View(_W, (_LC,), Reason.WAITING, Word.WRITING),
    (State.FAILED, Outcome.FAILED, False): View(_F, (_LU,), Reason.FAILED, Word.UNCOMMITTED),
    (State.FAILED, Outcome.FAILED, True): View(_F, (_LC,), Reason.FAILED, Word.WRITING),
    (State.COMMITTED, Outcome.WRITTEN, False): View(_W, (_LR,), Reason.DURABLE,
                                                    Word.COMMITTED),
    **{(State.DROPPED, outcome, pending): View(agree, (), Reason.BEING_WRITTEN, Word.NONE)
       for outcome, agree in ((Outcome.NONE, _T), (Outcome.WRITTEN, _W),
                              (Outcome.FAILED, _F))
       for pending in (False, True)},
}


def drain_of(lists: frozenset[str]) -> Word:
  """What ``sidecar drain`` calls a step that a sidecar's Status lists in ``lists``
  (:data:`VIEWS` read backwards; a set no row has, from a sidecar of another release:
  writing while any list says it goes on, else as its lists say)."""
  return _DRAIN_OF.get(lists, Word.WRITING if Listed.COMMITTING in lists or Listed.WRITING
                       in lists else Word.UNCOMMITTED if Listed.UNCOMMITTED in lists
                       else Word.COMMITTED)


_DRAIN_OF: dict[frozenset[str], Word] = {
    frozenset(v.lists): v.drain for v in VIEWS.values() if v.lists}
