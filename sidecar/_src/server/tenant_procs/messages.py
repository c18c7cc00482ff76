"""What crosses between the sidecar and a tenant's process: one frozen value per message.

Each is a JSON header on a socket of ``wire/ipc.py``'s framing (at most ``ipc.MAX_MESSAGE``),
``{"kind": ..., fields}``, followed by ``nbytes`` raw bytes where a message carries some
(``CARRIES``; :func:`send`, :func:`recv`); nothing is unpickled. A tenant process may be
its tenant's to run as it likes (its ``uid``'s own), so what it sends is read as a client's
request is: :func:`recv` takes only the kinds its caller expects, every field is checked
for its type and range (``from_dict``), and the raw bytes a header announces are refused
past the caller's bound before any is read. A malformed message is
``InvalidArgumentError`` naming what was wrong. The table of messages is in
ARCHITECTURE.md ("Tenant processes").
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any, ClassVar, TypeVar

from sidecar._src.core import errors
from sidecar._src.wire import ipc

# Ints in a message: offsets, sizes, generations (63-bit), counts.
_INT_MAX = (1 << 63) - 1
# Bytes of a name or a path in a message; items of a list (a batch's leaves and blocks, a
# check's sizes, a shape's dimensions).
_STR_MAX = 4096
_LIST_MAX = ipc.MAX_ALLOC_BLOCKS
_DIMS_MAX = 64
# What raw bytes a message may announce at most: a call's request or response, a read's
# data (each bounded further by its job: the sidecar's max_message_size).
PAYLOAD_MAX = 1 << 31

M = TypeVar("M", bound="Message")


class Message:
  """A message's kind (its class's ``KIND``) and its checked fields."""
  KIND: ClassVar[str] = ""
  # Whether ``nbytes`` raw bytes follow the message (its field ``nbytes``).
  CARRIES: ClassVar[bool] = False
  # Each field and its check: a function of the value that returns it, or raises
  # TypeError/ValueError saying why.
  FIELDS: ClassVar[dict[str, Any]] = {}

  def to_dict(self) -> dict[str, Any]:
    return {"kind": self.KIND, **{f: getattr(self, f) for f in self.FIELDS}}

  @classmethod
  def from_dict(cls: type[M], d: dict[str, Any]) -> M:
    """The message ``d`` is (its ``kind`` this class's), every field checked.

    Raises:
      InvalidArgumentError: a field missing, of the wrong type or out of range; naming it.
    """
    values = {}
    for name, check in cls.FIELDS.items():
      if name not in d:
        raise errors.InvalidArgumentError(f"a {cls.KIND} message has no {name!r}")
      try:
        values[name] = check(d[name])
      except (TypeError, ValueError) as e:
        raise errors.InvalidArgumentError(
            f"a {cls.KIND} message's {name!r} is {str(e)[:200]}") from None
    return cls(**values)


def _int(v: Any) -> int:
  if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _INT_MAX:
    raise ValueError(f"not an int in [0, 2^63): {v!r:.60}")
  return v


def _opt_int(v: Any) -> int | None:
  return None if v is None else _int(v)


def _bool(v: Any) -> bool:
  if not isinstance(v, bool):
    raise TypeError(f"not a bool: {v!r:.60}")
  return v


def _str(v: Any) -> str:
  if not isinstance(v, str) or len(v) > _STR_MAX:
    raise ValueError(f"not a str of at most {_STR_MAX} characters: {v!r:.60}")
  return v


def _float(v: Any) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9:
    raise ValueError(f"not seconds in [0, 1e9): {v!r:.60}")
  return float(v)


def _ints(v: Any, most: int = _LIST_MAX) -> tuple[int, ...]:
  if not isinstance(v, list) or len(v) > most:
    raise ValueError(f"not a list of at most {most} ints: {v!r:.60}")
  return tuple(_int(x) for x in v)


def _shape(v: Any) -> tuple[int, ...]:
  return _ints(v, _DIMS_MAX)


def _leaves(v: Any) -> tuple[tuple[int, ...], ...]:
  """A batch's blocks by offset: one list per leaf, one offset per row range."""
  if not isinstance(v, list) or len(v) > _LIST_MAX:
    raise ValueError(f"not a list of at most {_LIST_MAX} leaves: {v!r:.60}")
  leaves = tuple(_ints(leaf) for leaf in v)
  if sum(len(leaf) for leaf in leaves) > _LIST_MAX:
    raise ValueError(f"more than {_LIST_MAX} blocks in all")
  return leaves


def _dict(v: Any) -> dict[str, Any]:
  if not isinstance(v, dict):
    raise TypeError(f"not an object: {v!r:.60}")
  return v


def _strs(v: Any) -> tuple[str, ...]:
  if not isinstance(v, list) or len(v) > _LIST_MAX:
    raise ValueError(f"not a list of names: {v!r:.60}")
  return tuple(_str(x) for x in v)


def _payload(v: Any) -> int:
  n = _int(v)
  if n > PAYLOAD_MAX:
    raise ValueError(f"{n} bytes, more than a message carries ({PAYLOAD_MAX})")
  return n


# ---- the control socket -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Hello(Message):
  """The sidecar's first message to a new tenant process: who it is and what to load."""
  KIND = "hello"
  FIELDS = {"tenant": _str, "limits": _dict, "imports": _strs, "tmp": _str, "sys_path": _strs}
  tenant: str
  limits: dict[str, Any]
  imports: tuple[str, ...]
  tmp: str
  sys_path: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Ready(Message):
  """A tenant process's answer to its hello: its limits applied, its modules imported."""
  KIND = "ready"
  FIELDS = {"pid": _int}
  pid: int


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaFd(Message):
  """An arena of the tenant's (its memfd beside the message, SCM_RIGHTS): its id here."""
  KIND = "arena"
  FIELDS = {"arena": _int, "size": _int}
  arena: int
  size: int


@dataclasses.dataclass(frozen=True, slots=True)
class JobFd(Message):
  """A new job: its socket's end beside the message (SCM_RIGHTS)."""
  KIND = "job"


# ---- a job: what the sidecar asks ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CallJob(Message):
  """A unary call: its serialized CallRequest follows (``nbytes`` raw bytes). ``splice``:
  no worker session, the response's large arrays spliced into its bytes
  (``pbscan.splice_arrays``, for gRPC's Call and CallParts)."""
  KIND = "call"
  CARRIES = True
  FIELDS = {"name": _str, "code_hash": _str, "nbytes": _payload, "splice": _bool,
            "inline_limit": _int}
  name: str
  code_hash: str
  nbytes: int
  splice: bool
  inline_limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class StreamJob(Message):
  """A stream of a registered iterable: its serialized CallRequest follows; each ``Next``
  asks for one item."""
  KIND = "stream"
  CARRIES = True
  FIELDS = {"name": _str, "code_hash": _str, "nbytes": _payload, "inline_limit": _int}
  name: str
  code_hash: str
  nbytes: int
  inline_limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class FeedJob(Message):
  """A feed: its serialized CallRequest (kwargs, FeedSpec) follows; ``roots`` where its
  pipeline may read (``DataRoots.to_dict``); ``arena`` the arena its batches' blocks are
  made in (its feed workers map it); each ``Next`` asks for one batch (``length_only``: one
  ``Length`` instead)."""
  KIND = "feed"
  CARRIES = True
  FIELDS = {"name": _str, "code_hash": _str, "nbytes": _payload, "roots": _dict,
            "length_only": _bool, "arena": _int}
  name: str
  code_hash: str
  nbytes: int
  roots: dict[str, Any]
  length_only: bool
  arena: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReadJob(Message):
  """A checkpoint read from storage: the shard ``record`` (``ShardRecord.to_dict``) of the
  committed item ``final_dir``, which the sidecar checked lies beneath the tenant's roots;
  ``to_arena``: into a block (``Alloc``), else its bytes back (``Data``)."""
  KIND = "read"
  FIELDS = {"final_dir": _str, "record": _dict, "to_arena": _bool, "checked": _bool}
  final_dir: str
  record: dict[str, Any]
  to_arena: bool
  checked: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Next(Message):
  """One credit: make the next item (or batch)."""
  KIND = "next"


@dataclasses.dataclass(frozen=True, slots=True)
class Granted(Message):
  """The sidecar's answer to an ``Alloc``, a ``View``, a ``Lease``, a ``Check``, a
  ``StartWorkers`` or a ``StopWorkers``: the block (its arena's id, offset, generation;
  zeros where none), and for a ``Free`` whether its tenant has a turn free."""
  KIND = "granted"
  FIELDS = {"arena": _int, "offset": _int, "generation": _int, "free": _bool}
  arena: int = 0
  offset: int = 0
  generation: int = 0
  free: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Refused(Message):
  """The sidecar's refusal of what the tenant process asked (an error dict)."""
  KIND = "refused"
  FIELDS = {"error": _dict}
  error: dict[str, Any]


# ---- a job: what the tenant process asks and answers ----------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class View(Message):
  """An argument's arena reference: the sidecar checks the caller's worker session holds
  the block and pins it for the job."""
  KIND = "view"
  FIELDS = {"offset": _int, "generation": _int, "nbytes": _int}
  offset: int
  generation: int
  nbytes: int


# What an ``Alloc`` is for: a result's array (leased to the caller's worker session), an
# array ``sidecar.empty`` makes (pinned for the job), a feed batch's array (``BatchBlocks``),
# a read's shard (pinned, then leased to the caller).
USES = ("result", "empty", "batch", "read")


def _use(v: Any) -> str:
  if v not in USES:
    raise ValueError(f"not one of {USES}: {v!r:.60}")
  return v


@dataclasses.dataclass(frozen=True, slots=True)
class Alloc(Message):
  """A new block of ``nbytes`` for ``use``; a batch's with its array's shape and dtype."""
  KIND = "alloc"
  FIELDS = {"nbytes": _int, "use": _use, "shape": _shape, "dtype": _str}
  nbytes: int
  use: str
  shape: tuple[int, ...] = ()
  dtype: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Lease(Message):
  """A result array that lies in a block the job viewed or made already (an argument
  returned): leased to the caller's worker session as it is, nothing copied."""
  KIND = "lease"
  FIELDS = {"arena": _int, "offset": _int, "nbytes": _int}
  arena: int
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Check(Message):
  """A feed batch's block sizes, once its first element gave them: the sidecar refuses
  one that can never fit (``BatchBlocks.check_batch``)."""
  KIND = "check"
  FIELDS = {"sizes": _ints}
  sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class StartWorkers(Message):
  """Starts the feed's worker processes (as many as its request asked, which its tenant's
  ``feed_workers`` counted): the sidecar starts them, as it starts the tenant's process,
  each held to the tenant's limits and user (``feed_worker.py``)."""
  KIND = "start_workers"


@dataclasses.dataclass(frozen=True, slots=True)
class StopWorkers(Message):
  """Stops the feed's worker processes."""
  KIND = "stop_workers"


@dataclasses.dataclass(frozen=True, slots=True)
class Free(Message):
  """Asks whether the tenant has a turn at the feed workers free now (``Granted.free``;
  ``pool/shares.py``: the turns stay the sidecar's)."""
  KIND = "free"


@dataclasses.dataclass(frozen=True, slots=True)
class Submit(Message):
  """Sends batch ``(epoch, position)`` to a feed worker, into the blocks of ``leaves``
  (each a block the job made for a batch, by offset); answered with its ``Ticket``."""
  KIND = "submit"
  FIELDS = {"epoch": _int, "position": _int, "leaves": _leaves}
  epoch: int
  position: int
  leaves: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket(Message):
  """A batch sent to feed worker ``worker`` as its ``seq``-th task."""
  KIND = "ticket"
  FIELDS = {"worker": _int, "seq": _int}
  worker: int
  seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Wait(Message):
  """Waits for the batch of a ``Ticket``; answered with ``Waited``."""
  KIND = "wait"
  FIELDS = {"worker": _int, "seq": _int}
  worker: int
  seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Waited(Message):
  """A feed worker filled the batch, in ``seconds``."""
  KIND = "waited"
  FIELDS = {"seconds": _float}
  seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Batch(Message):
  """A feed batch: its structure (a serialized ``pb.Value``, ``nbytes`` raw bytes follow),
  each leaf's blocks by offset (one per row range), its state and its seconds."""
  KIND = "batch"
  CARRIES = True
  FIELDS = {"nbytes": _payload, "leaves": _leaves, "state": _dict, "seconds": _float}
  nbytes: int
  leaves: tuple[tuple[int, ...], ...]
  state: dict[str, Any]
  seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Item(Message):
  """A stream's item: its serialized ``pb.Value`` follows (``nbytes``)."""
  KIND = "item"
  CARRIES = True
  FIELDS = {"nbytes": _payload}
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Response(Message):
  """A call's serialized CallResponse follows (``nbytes``)."""
  KIND = "response"
  CARRIES = True
  FIELDS = {"nbytes": _payload}
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Length(Message):
  """A feed's length in global batches (None: unknown, or for ever)."""
  KIND = "length"
  FIELDS = {"length": _opt_int}
  length: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class Data(Message):
  """A read's shard: ``nbytes`` raw bytes follow, or (``nbytes`` 0) it is in the block the
  job's ``Alloc`` made at ``offset`` of arena ``arena``."""
  KIND = "data"
  CARRIES = True
  FIELDS = {"nbytes": _payload, "arena": _int, "offset": _int}
  nbytes: int
  arena: int = 0
  offset: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class End(Message):
  """The job is done (a stream's or a feed's last item was sent)."""
  KIND = "end"


@dataclasses.dataclass(frozen=True, slots=True)
class Error(Message):
  """The job failed: ``protocol.error_dict`` of what it raised."""
  KIND = "error"
  FIELDS = {"error": _dict}
  error: dict[str, Any]


_ALL: tuple[type[Message], ...] = (
    Hello, Ready, ArenaFd, JobFd, CallJob, StreamJob, FeedJob, ReadJob, Next, Granted,
    Refused, View, Alloc, Lease, Check, StartWorkers, StopWorkers, Free, Submit, Ticket,
    Wait, Waited, Batch, Item, Response, Length, Data, End, Error)
BY_KIND: dict[str, type[Message]] = {m.KIND: m for m in _ALL}
assert len(BY_KIND) == len(_ALL)


def send(sock: socket.socket, message: Message, payload: Any = None,
         fds: tuple[int, ...] = ()) -> None:
  """Sends ``message`` (with ``fds``), then ``payload``'s bytes where it has some (its
  ``nbytes`` must say how many)."""
  ipc.send(sock, message.to_dict(), fds)
  if payload is not None and len(memoryview(payload)):
    sock.sendall(payload)


def recv(sock: socket.socket, expect: tuple[type[Message], ...], *, payload_limit: int = 0,
         max_fds: int = 0, what: str) -> tuple[Message, bytearray | None, list[int]]:
  """The next message, one of ``expect``; its raw bytes (those its ``nbytes`` announce, at
  most ``payload_limit``), and the descriptors beside it.

  Raises:
    InvalidArgumentError: not JSON, not one of ``expect``, or a field malformed; naming
      ``what`` sent it. ResourceExhaustedError: raw bytes past ``payload_limit``.
    ConnectionError: the other end closed the socket.
  """
  d, fds = ipc.recv(sock, max_fds=max_fds)
  try:
    kind = d.get("kind")
    cls = BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None or cls not in expect:
      raise errors.InvalidArgumentError(
          f"{what} sent a message of kind {kind!r:.60}, where one of "
          f"{[c.KIND for c in expect]} was expected")
    try:
      message = cls.from_dict(d)
    except errors.InvalidArgumentError as e:
      raise errors.InvalidArgumentError(f"{what}: {e}") from None
    payload = None
    nbytes = getattr(message, "nbytes", 0) if cls.CARRIES else 0
    if nbytes:
      if nbytes > payload_limit:
        raise errors.ResourceExhaustedError(
            f"{what} answered with a {cls.KIND} of {nbytes} bytes, more than the "
            f"{payload_limit} it may (max_message_size); pass large arrays through a "
            "Worker's arena")
      payload = recv_exactly(sock, nbytes)
  except BaseException:
    for fd in fds:
      _close(fd)
    raise
  return message, payload, fds


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
  """``n`` bytes, received into one buffer (no copy beyond it).

  Raises:
    ConnectionError: the socket ended first.
  """
  buffer = bytearray(n)
  view = memoryview(buffer)
  got = 0
  while got < n:
    k = sock.recv_into(view[got:])
    if not k:
      raise ConnectionError("the peer closed the socket")
    got += k
  return buffer


def _close(fd: int) -> None:
  try:
    os.close(fd)
  except OSError:
    pass
