"""The worker: lives in the process that owns the devices, beside one sidecar.

It attaches to its host's sidecar over a Unix socket, receives the arena's
memfd once (with a pool file: its tenant's own arena, nothing of another's), and
from then on turns arena descriptors into numpy views with no copy. Every view
holds its block: on the CPU backend ``jax.device_put`` of a page-aligned view
aliases the memory (a torch tensor made by ``from_numpy`` always does), so the
block is given back only when no array can read it any more.

It knows no framework: a framework's Worker (``jax/worker.py``) turns views into its
arrays, and streams over this socket are opened by ``streams/socket_transport.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import json
import math
import os
import queue
import select
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.core import env as env_lib, errors, progress, stacks, stall
from sidecar._src.wire import codec, ipc, protocol

ENV_ADDRESS = env_lib.ADDRESS
# How long the release thread lets frees gather before it sends them. Streams carry
# frees with their credits; this thread sends the rest, a message per interval at
# most, so a fast stream is not slowed by a free message (and a wake-up) per batch.
FREE_DELAY_S = 0.01
# An alloc that found no room waits this long for blocks under release before it fails.
RECLAIM_S = 2.0
RECLAIM_POLL_S = 0.02
JOIN_S = 2.0  # close() waits this long for the releasing thread (it sleeps FREE_DELAY_S)


@dataclasses.dataclass(frozen=True, slots=True)
class TrainerProcess:
  """Who drives a host in a job of several trainer processes: told to its sidecar at
  attach, which then takes ``device_ids`` as its host's devices (unless ``--device-ids``)."""
  index: int
  device_ids: tuple[int, ...]

  def to_dict(self) -> dict[str, Any]:
    return {"process_index": self.index, "device_ids": list(self.device_ids)}


class State(enum.Enum):
  ATTACHED = "attached"
  CLOSING = "closing"  # close() was called; waits for live views to die
  CLOSED = "closed"


def _env_int(name: str) -> int:
  """``$name`` as an int >= 0, or -1 (unset, or not one): only told to the sidecar."""
  text = env_lib.get(name) or ""
  return int(text) if text.isdigit() and len(text) < 10 else -1


def _env_token() -> str | None:
  """``$SIDECAR_TOKEN`` (or its file's), None where there is none or it cannot be read:
  only a pool's sidecar asks it, and says so."""
  try:
    return env_lib.token()
  except (OSError, errors.SidecarError):
    return None


def socket_path(address: str | None) -> str:
  """The Unix socket path in ``unix:///path``, ``unix:/path`` or ``/path``."""
  address = address or env_lib.get(ENV_ADDRESS)
  if not address:
    raise errors.InvalidArgumentError(
        f"no sidecar address: pass Worker(address='unix:///run/sidecar/sidecar.sock') or set "
        f"{ENV_ADDRESS}")
  for prefix in ("unix://", "unix:"):
    if address.startswith(prefix):
      return address[len(prefix):]
  if address.startswith("/") or address.startswith("."):
    return address
  raise errors.InvalidArgumentError(
      f"worker address {address!r} is not a Unix socket; workers attach with "
      "'unix:///path/to/sidecar.sock' (TCP addresses are for the Controller)")


class Worker:
  """Attaches to the sidecar on this host and maps its arena.

  Example::

    worker = Worker("unix:///run/sidecar/sidecar.sock")
    array, ref = worker.put(np.arange(1 << 20))  # in the arena: ref is all that travels

  Args:
    address: the sidecar's Unix socket (``unix:///path``); default ``$SIDECAR_ADDRESS``.
    timeout: seconds the sidecar is given to answer anything (the attach, each request,
      a sign of life while a stream waits for its next item or a call for its result);
      default ``$SIDECAR_PEER_TIMEOUT`` or 30. A sidecar silent for longer (hung, SIGSTOPped)
      is lost: what waited on it raises HostLostError, and so does every later request
      of this Worker (make a new one).
    process: under several trainer processes, this one's index and devices, for the
      sidecar (a framework's Worker fills it in); None: say nothing.
    token: the tenant's token, which a pool's sidecar (``--pool``) asks at attach; default
      ``$SIDECAR_TOKEN`` or ``$SIDECAR_TOKEN_FILE``'s.
  """

  def __init__(self, address: str | None = None, *, timeout: float | None = None,
               process: TrainerProcess | None = None, token: str | None = None):
    self.path = socket_path(address)
    self.timeout = env_lib.silence_timeout(timeout)
    self._lost: str | None = None  # why the sidecar counts as lost, once it does
    self._lock = threading.Lock()
    try:  # the serving user checked before the token goes (ipc.check_server)
      self._sock = ipc.connect(self.path, timeout=self.timeout)
    except OSError as e:
      raise errors.HostLostError(
          f"cannot attach to the sidecar at {self.path}: {e.strerror or e}; is `sidecar serve "
          f"--socket {self.path}` running on this host?") from None
    try:
      hello = {"op": "attach", "pid": os.getpid(), "queue": True,
               "versions": protocol.versions_dict(protocol.local_versions()),
               # Who it is in its job, for the sidecar's stall signal (server/goodput/steps.py).
               "rank": _env_int(env_lib.PROCESS_ID), "restart": _env_int(env_lib.RESTART)}
      stacks.arm()  # a stalled trainer's stacks, on the launcher's signal
      if process is not None:  # who drives this host
        hello["process"] = process.to_dict()
      if (token := token if token is not None else _env_token()) is not None:
        hello["token"] = token  # whose arena share this worker's blocks count against
      try:
        ipc.send(self._sock, hello)
      except OSError:
        pass  # Refused (too many connections) before it read: its answer says why.
      reply, fds = ipc.recv(self._sock, max_fds=1)
    except (OSError, ConnectionError) as e:
      self._sock.close()
      raise errors.HostLostError(f"the sidecar at {self.path} closed the attach: {e}") from None
    if "error" in reply:
      self._sock.close()
      raise protocol.error_from_dict(reply["error"], host=self.path)
    self._replies = ipc.FrameReader(self._sock, limit=ipc.MAX_MESSAGE)
    self.session: str = reply["session"]
    self.identity: dict[str, Any] = reply["identity"]
    self.host_id: int = self.identity["host_id"]
    # A pool tenant's arena makes its pages as they are written: populating the mapping
    # would make them all.
    self.arena = shm.Arena.attach(fds[0], int(reply["arena_size"]),
                                  populate=bool(reply.get("arena_populate", True)))
    # A pool tenant's arena (made as written): its allocs may wait their turn in the
    # admission queue (_flush_frees); elsewhere one fails at once, and _reclaim retries.
    self._queues = not bool(reply.get("arena_populate", True))
    self.state = State.ATTACHED
    self._live = 0
    self._generations: dict[int, int] = {}  # block offset -> generation, of live views
    self._freed: queue.SimpleQueue = queue.SimpleQueue()
    self._releasing = False  # the release thread holds frees it has not sent yet
    self._releaser = threading.Thread(target=self._release_loop, name="sidecar-worker-free",
                                      daemon=True)
    self._releaser.start()

  # ---- blocks ------------------------------------------------------------

  def _request(self, message: dict[str, Any], *, wait: float = 0.0,
               timeout: float | None = None,
               queued: progress.Queued | None = None) -> dict[str, Any]:
    """Sends ``message``, returns the reply: within ``wait`` (the time the sidecar may take
    on purpose, an alloc's) plus ``timeout`` (default the peer timeout) seconds, or the
    peer timeout after each report of its place in a pool's admission queue (``queued``
    shows them)."""
    timeout = self.timeout if timeout is None else timeout
    with self._lock:
      if self.state is State.CLOSED:
        raise errors.ClosedError("this Worker is closed")
      if self._lost is not None:
        raise errors.HostLostError(self._lost, host_id=self.host_id)
      try:
        ipc.send(self._sock, message)
        reply = self._reply(wait + timeout)
        while "queued" in reply:  # its turn has not come: the sidecar says where it stands
          if queued is not None:
            queued.update(reply["queued"])
          reply = self._reply(self.timeout)
      except TimeoutError as e:
        # Hung or stopped. The connection stays open (it is what holds this worker's
        # blocks, which live views still read), but its late reply must never be taken
        # for another request's: every later request is refused.
        self._lost = (f"the sidecar of host {self.host_id} at {self.path} did not answer "
                      f"{message.get('op')!r} ({e}); it counts as lost (hung or stopped?): "
                      f"make a new Worker once it serves again")
        raise errors.HostLostError(self._lost, host_id=self.host_id) from None
      except (OSError, ConnectionError) as e:
        raise errors.HostLostError(
            f"the sidecar of host {self.host_id} at {self.path} is gone: {e}",
            host_id=self.host_id) from None
    if "error" in reply:
      raise protocol.error_from_dict(reply["error"], host=self.path, host_id=self.host_id)
    return reply

  def _reply(self, timeout: float) -> dict[str, Any]:
    """The sidecar's reply to the request just sent, within ``timeout`` s (else
    TimeoutError); the lock is held.

    A Ctrl-C (KeyboardInterrupt) while it is awaited must not leave it in the socket,
    where the next request would take it for its own: it is read all the same (the
    reader keeps a part read), a block it grants is given back, then the interrupt
    goes on.
    """
    interrupted: KeyboardInterrupt | None = None
    deadline = time.monotonic() + timeout
    while True:
      try:
        if not self._replies.buffered():
          ready, _, _ = select.select([self._sock], [], [], max(deadline - time.monotonic(), 0))
          if not ready:
            raise TimeoutError(f"no answer within {timeout:.3g} s")
        reply = json.loads(self._replies.read())
        break
      except KeyboardInterrupt as e:
        interrupted = e
      except json.JSONDecodeError as e:
        raise errors.InvalidArgumentError(f"malformed reply from the sidecar: {e}") from None
    if interrupted is not None and isinstance(reply, dict) and "queued" in reply:
      # Waiting its turn in a pool's queue: leave the queue, then read its answer.
      with contextlib.suppress(OSError):
        ipc.send(self._sock, {"op": "cancel"})
      reply = self._reply(timeout)
      while isinstance(reply, dict) and "queued" in reply:
        reply = self._reply(timeout)
    if interrupted is not None:
      granted = [[b[0], b[2]] for b in reply.get("blocks", ())]
      if granted:
        with contextlib.suppress(OSError):
          ipc.send(self._sock, {"op": "free", "blocks": granted})
      raise interrupted
    if not isinstance(reply, dict):
      raise errors.InvalidArgumentError(f"malformed reply from the sidecar: {reply!r:.80}")
    return reply

  def _check_open(self) -> None:
    if self.state is not State.ATTACHED:
      raise errors.ClosedError(f"this Worker is {self.state.value}; make a new one")

  @property
  def quiet_s(self) -> float:
    """How long a wait on this sidecar (a stream's next item, a call's result) hears
    nothing before it asks for a sign of life (:meth:`check_alive` with as long again):
    half the timeout, so a silent sidecar is lost within about the timeout."""
    return self.timeout / 2

  def check_alive(self, timeout: float | None = None) -> None:
    """Asks the sidecar for a sign of life; HostLostError if none comes within ``timeout``
    seconds (default the peer timeout). Its connection answers even while the sidecar
    is busy producing a stream's next item."""
    self._request({"op": "ping"}, timeout=timeout)

  def view(self, ref: codec.ArenaRef, *, private: bool = False) -> np.ndarray:
    """The array ``ref`` names, on the arena (no copy), held while any view lives.

    The block must be leased to this worker (results of calls made with it are).
    ``private``: through a copy-on-write mapping (``Arena.lease``): what the caller writes
    stays its own, the block is never changed; such an array is no block of this worker's
    (:meth:`ref_of`), so handing it back to the sidecar copies it.
    """
    self._check_open()
    with self._lock:
      self._live += 1
      self._generations[ref.offset] = ref.generation
    holder = self.arena.lease(ref.offset, ref.nbytes,
                              lambda: self._freed.put((ref.offset, ref.generation)),
                              private=private)
    return codec.as_array(holder, ref)

  def ref_of(self, array: np.ndarray) -> codec.ArenaRef | None:
    """The descriptor of an array that starts a block this worker holds, else None.

    Sending such an array to the sidecar needs no copy: only the descriptor travels.
    """
    offset = self.arena.contains(array)
    if offset is None or not array.flags.c_contiguous:
      return None
    with self._lock:
      generation = self._generations.get(offset)
    if generation is None:
      return None
    return codec.ArenaRef(offset, array.nbytes, generation, array.dtype.name, array.shape)

  def empty(self, shape: tuple[int, ...], dtype: Any, *, timeout: float | None = None
            ) -> tuple[np.ndarray, codec.ArenaRef]:
    """A new array in the arena (for arguments and saves), and its descriptor.

    ``timeout``: seconds to wait for room (ResourceExhaustedError after, naming the
    tenant, its place in the queue and its quota); None: a pool's sidecar queues the
    request until its turn comes (its place shown on a tqdm line), any other answers at
    once."""
    self._check_open()
    dtype = np.dtype(dtype)
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    ((offset, _, generation),) = self._alloc([nbytes], timeout)
    ref = codec.ArenaRef(offset, nbytes, generation, dtype.name, tuple(shape))
    return self.view(ref), ref

  def _alloc(self, sizes: list[int], timeout: float | None) -> list[list[int]]:
    """``[offset, nbytes, generation]`` of a new block of each size: all or none."""
    # While it waits its turn in a pool's queue, the sidecar reports within a third of the
    # peer timeout: the reports are its sign of life.
    message: dict[str, Any] = {"op": "alloc", "sizes": sizes, "report_s": self.timeout / 3}
    if timeout is not None:
      message["timeout"] = timeout
    bar = progress.queued(f"{shm.format_size(sum(sizes))} of arena", timeout)
    self._flush_frees()
    try:
      while True:
        try:
          return self._request(message, wait=timeout or 0.0, queued=bar)["blocks"]
        except errors.BusyError:
          raise
        except errors.ResourceExhaustedError:
          # Blocks the caller no longer references may still be held (a cycle, a device
          # release under way): let them go first, and ask again while any do.
          if not self._reclaim():
            raise
    finally:
      bar.close()

  def empty_like(self, arrays: Sequence[Any], *, timeout: float | None = None
                 ) -> list[tuple[np.ndarray, codec.ArenaRef]]:
    """New arrays in the arena shaped as ``arrays`` (a save's shards: arrays, or anything
    with their ``shape``, ``dtype`` and ``nbytes``), and their descriptors: one round
    trip for up to ``ipc.MAX_ALLOC_BLOCKS`` of them, all or none."""
    self._check_open()
    out: list[tuple[np.ndarray, codec.ArenaRef]] = []
    try:
      for start in range(0, len(arrays), ipc.MAX_ALLOC_BLOCKS):
        part = arrays[start:start + ipc.MAX_ALLOC_BLOCKS]
        sizes = [max(a.nbytes, 1) for a in part]
        for a, n, (offset, _, generation) in zip(part, sizes, self._alloc(sizes, timeout)):
          ref = codec.ArenaRef(offset, n, generation, a.dtype.name, tuple(a.shape))
          out.append((self.view(ref), ref))
    except BaseException:
      out.clear()  # the views let their blocks go
      raise
    return out

  def put(self, array: np.ndarray, *, timeout: float | None = None
          ) -> tuple[np.ndarray, codec.ArenaRef]:
    """Copies ``array`` into the arena; returns the arena copy and its descriptor."""
    array = np.asarray(array)
    dst, ref = self.empty(array.shape, array.dtype, timeout=timeout)
    shm.copy(dst, array)
    return dst, ref

  def take_freed(self) -> list[int]:
    """Blocks let go of since the last call, flattened (offset, generation) pairs.

    A stream sends them with its next credit; the release thread sends the rest.
    """
    blocks = self._drain([])
    if blocks:
      with self._lock:
        self._forget(blocks)
    return [x for block in blocks for x in block]

  def _drain(self, blocks: list) -> list:
    """``blocks`` and every free waiting in the queue after them."""
    while True:
      try:
        item = self._freed.get_nowait()
      except queue.Empty:
        return blocks
      if item is not None:
        blocks.append(item)

  def _forget(self, blocks) -> None:
    """Counts (offset, generation) blocks as let go of; the lock is held."""
    self._live -= len(blocks)
    for offset, generation in blocks:
      if self._generations.get(offset) == generation:
        del self._generations[offset]

  def _release_loop(self) -> None:
    while True:
      item = self._freed.get()
      self._releasing = True
      try:
        time.sleep(FREE_DELAY_S)  # Let frees gather: one message for many, fewer wake-ups.
        blocks = self._drain([item] if item is not None else [])
        with self._lock:
          self._send_frees(blocks)
          done = self.state is State.CLOSING and self._live == 0
          if done:
            self._shutdown()
      finally:
        self._releasing = False
      if done or self.state is State.CLOSED:
        return

  def _flush_frees(self) -> None:
    """Sends every free let go of so far, those the release thread gathers too, before an
    alloc that may wait its turn in a pool's admission queue: the lock it holds through
    that wait would keep them back, and the room it waits for may be theirs (a call's
    result dropped just before the next call: issue 79 item 4, a wait to its timeout)."""
    if not self._queues:
      return
    deadline = time.monotonic() + JOIN_S
    while self._releasing and time.monotonic() < deadline:
      time.sleep(FREE_DELAY_S / 10)
    blocks = self._drain([])
    if blocks:
      with self._lock:
        self._send_frees(blocks)

  def _send_frees(self, blocks: list) -> None:
    """Counts ``blocks`` let go of and tells the sidecar; the lock is held."""
    self._forget(blocks)
    # A lost sidecar gets no more frees (the last may have left half a frame): the
    # session keeps its blocks until this Worker closes, and then all go back at once.
    if blocks and self.state is not State.CLOSED and self._lost is None:
      try:
        ipc.send(self._sock, {"op": "free", "blocks": blocks})
      except TimeoutError:
        self._lost = (f"the sidecar of host {self.host_id} at {self.path} took no frees "
                      f"for {self.timeout:.3g} s; it counts as lost (hung or stopped?)")
      except OSError:
        pass  # Gone: its end of the connection released everything.

  def _reclaim(self) -> bool:
    """Lets go of every block nothing references any more, before a request that found no
    room fails: collects reference cycles (an array in one keeps its block until the
    collector runs), then waits up to ``RECLAIM_S`` for releases under way (the device
    runtime lets go of an array that aliases a block after its last computation) and sends
    their frees ahead of the retry. True if any block went back."""
    before = self.live_blocks
    deadline = time.monotonic() + RECLAIM_S
    while True:
      gc.collect()
      blocks = self._drain([])
      with self._lock:
        self._send_frees(blocks)
        if self._live < before:
          return True
      if time.monotonic() >= deadline:
        return False
      time.sleep(RECLAIM_POLL_S)

  # ---- the goodput ledger ------------------------------------------------

  def send_ledger(self, message: dict[str, Any], *, reply: bool, wait: bool) -> bool:
    """Sends a message of the goodput ledger (``controller/goodput.py``) on this session.

    With ``reply`` it is a request (the sidecar's error raised); else a frame with no
    answer, sent only if the socket is free now (``wait``: within a second), so a
    trainer's step never waits behind another thread's request. Returns whether it went.
    """
    if reply:
      self._request(dict(message, reply=True))
      return True
    return self._send_frame(message, wait=wait)

  def _send_frame(self, message: dict[str, Any], *, wait: bool) -> bool:
    """Sends ``message``, which has no answer, if the socket is free now (``wait``: within
    a second); returns whether it went."""
    if not self._lock.acquire(blocking=wait, timeout=1.0 if wait else -1):
      return False
    try:
      if self.state is not State.ATTACHED or self._lost is not None:
        return False
      ipc.send(self._sock, message)
      return True
    except TimeoutError:  # as a free's: a part of the frame may be in the socket
      self._lost = (f"the sidecar of host {self.host_id} at {self.path} took no message "
                    f"for {self.timeout:.3g} s; it counts as lost (hung or stopped?)")
      return False
    except OSError:
      return False  # gone: its end of the session writes the death
    finally:
      self._lock.release()

  # ---- the stall rule ----------------------------------------------------

  def tell(self, phase: stall.Phase) -> bool:
    """Tells the sidecar's stall rule that ``phase`` begins or ends (``core/stall.py``);
    returns whether it went. The Controller ends :data:`stall.STARTUP` at the first
    completed step; :meth:`phase` announces a long one."""
    return self._send_frame(phase.to_dict(), wait=True)

  @contextlib.contextmanager
  def phase(self, name: str, *, budget_s: float) -> Iterator[None]:
    """A long phase without steps (an evaluation, a large restore): while it lasts, the
    sidecar's stall rule waits up to ``budget_s`` seconds for a step before this trainer
    counts as stalled (``sidecar launch --stall-timeout``, docs/elastic.md).

    Example::

      with worker.phase("eval", budget_s=900):
        evaluate(state)

    Raises:
      InvalidArgumentError: ``name`` not 1..64 printable characters, or ``budget_s`` not
        seconds in (0, 86400].
    """
    try:
      begins = stall.Phase(name, budget_s)
    except ValueError as e:
      raise errors.InvalidArgumentError(str(e)) from None
    self.tell(begins)
    try:
      yield
    finally:
      self.tell(stall.Phase(name))

  # ---- streams -----------------------------------------------------------

  def check_usable(self) -> None:
    """Raises ClosedError if closed, HostLostError if its sidecar counts as lost."""
    self._check_open()
    if self._lost is not None:
      raise errors.HostLostError(self._lost, host_id=self.host_id)

  # ---- lifecycle ---------------------------------------------------------

  @property
  def live_blocks(self) -> int:
    with self._lock:
      return self._live

  def close(self) -> None:
    """Detaches and joins the releasing thread; idempotent. Blocks still read by live
    arrays stay held until they die: the thread sends their frees and ends with the last
    (then a later ``close()`` joins it)."""
    with self._lock:
      closing = self.state is State.ATTACHED
      if closing:
        self.state = State.CLOSING
        if self._live == 0:
          self._shutdown()
      done = self.state is State.CLOSED
    if closing:
      self._freed.put(None)  # Wakes the releaser so it can finish.
    if done and self._releaser is not threading.current_thread():
      self._releaser.join(timeout=JOIN_S)

  def hung_up(self, timeout: float = 0.0) -> bool:
    """Whether the sidecar closed its end (it exited), waiting up to ``timeout`` s."""
    if self.state is State.CLOSED:
      return True
    poller = select.poll()
    poller.register(self._sock, select.POLLRDHUP)  # hang-ups only, never a reply's bytes
    try:
      return bool(poller.poll(max(timeout, 0.0) * 1000))
    except (OSError, ValueError):  # closed meanwhile
      return True

  def _shutdown(self) -> None:
    self.state = State.CLOSED
    with contextlib.suppress(OSError):
      self._sock.close()
    self.arena.close()

  def __enter__(self) -> Worker:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"Worker(host_id={self.host_id}, path={self.path!r}, state={self.state.value})"
