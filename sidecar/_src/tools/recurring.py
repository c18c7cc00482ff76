"""``sidecar launch``'s rule for failures that recur: a trainer that fails the same way again
is not restarted.

A trainer that fails the same way (the same exit status and the same last error line of
its output) :data:`REPEATS` times in a row, either before its first step or at the same
step, ends the job with that failure instead of restarting it again
(:meth:`Failures.recurs`): a typo in a path, or a bug that raises in step 30, fails the
same way every time, and restarting it only hides the error under more output.
"Before its first step": its sidecar saw it attach and its clock never started (the same
signal as stalls). "At the same step": its position, the newest step the sidecars held
when its life began (what it resumed from: as read when the life before it failed) plus
the batches it took from their feeds, is the same in both lives. A trainer its sidecar
never saw (one that failed before its Worker attached, or one that uses no sidecar, as a
Grain + Orbax trainer under the same launcher) is restarted as before: no signal tells its
steps from none.

The signals come from the launch's watchdog (``watchdog.py``: it reads the sidecars'
Status, and taps each trainer's output for its last lines); the rule is here.
"""

from __future__ import annotations

import dataclasses
import re
import threading

from sidecar._src.tools import trainers

REPEATS = 2  # the same failure this often in a row (before a step, or at one) ends the job
# What `sidecar launch --help` says of the rule (the watchdog's HELP begins with it).
HELP = f"""\
A trainer that fails the same way (exit status and last error line) {REPEATS} times in a
row, after its Worker attached and before its first step, or at the same point (the step
it resumed from plus the batches its feeds handed it), is not restarted again: the job
ends with that failure.
"""
_ERROR_LINE = re.compile(rb"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*)$")
_LINE_CHARS = 300


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
  """One trainer's failure, as the rule compares them."""
  code: int
  line: str  # its output's last error line (or last line)
  stepped: bool  # its sidecar saw its first completed step
  seen: bool  # its sidecar saw it attach: "no step" means something
  position: int | None  # the step it resumed from + the batches it took (None: unknown)

  def same(self, other: Failure) -> bool:
    """The same failure: the same exit status and last error line, both before a first
    step, or both at one and the same known step."""
    if (self.code, self.line, self.seen, self.stepped) != (
        other.code, other.line, other.seen, other.stepped):
      return False
    return not self.stepped or self.position is not None and self.position == other.position


class Failures:
  """A launch's trainer failures, in order, and each rank's last lines of output, for the
  rule (:meth:`recurs`). Lines come from the threads that relay the output, failures from
  the launcher's: one lock."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._lines: dict[int, str] = {}  # rank -> its output's last error line
    self._last: dict[int, str] = {}  # rank -> its output's last line
    self._failures: list[Failure] = []  # the job's, in order

  def begin(self, rank: int) -> None:
    """Rank ``rank``'s output begins anew (a new process): its lines before are forgotten."""
    with self._lock:
      self._lines.pop(rank, None)
      self._last.pop(rank, None)

  def note(self, rank: int, line: bytes) -> None:
    """Notes a line of rank ``rank``'s output (``[host H] `` before it, as relayed, or not):
    its last line, and its last error line where it is one (``...Error: ...``)."""
    text = line.decode(errors="replace").strip()
    if not text:
      return
    text = text.split("] ", 1)[1] if text.startswith("[host ") and "] " in text else text
    error = _ERROR_LINE.match(text.encode())
    with self._lock:
      self._last[rank] = text[:_LINE_CHARS]
      if error:
        self._lines[rank] = text[:_LINE_CHARS]

  def recurs(self, rank: int, code: int, *, seen: bool, stepped: bool,
             position: int | None) -> str | None:
    """Notes that rank ``rank`` failed with ``code`` (``seen``: its sidecar saw it attach;
    ``stepped``: and its first step; ``position``: where it was, None where not known); the
    reason to end the job where this is the :data:`REPEATS`-th same failure in a row, before
    a first step or at the same step, else None."""
    with self._lock:
      line = self._lines.get(rank) or self._last.get(rank) or ""
      failure = Failure(code, line, stepped, seen, position)
      self._failures.append(failure)
      last = self._failures[-REPEATS:]
    if not failure.seen or len(last) < REPEATS or not all(f.same(failure) for f in last):
      return None
    where = "before its first step" if not failure.stepped else (
        f"at the same point of its run ({failure.position}: the step it resumed from plus "
        "the batches its feeds handed it, those sent ahead included, so not the step it "
        "raised in: its traceback names that)")
    return (f"it failed the same way {REPEATS} times in a row {where} "
            f"({trainers.how(code)}" + (f"; its last error: {line}" if line else "")
            + "): a restart would fail again; not restarting it")
