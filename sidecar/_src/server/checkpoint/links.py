"""Replica links, the sending side: one sidecar copies its staged shards into another's arena.

Runs in the sending sidecar, on an idle-class thread (``SCHED_IDLE``, as the writes:
the training step preempts it at once). A :class:`ReplicaLink` reaches one other sidecar
of the job (a ``records.ReplicaTarget``) over the same authenticated gRPC as the
controller (the job's token), its handshake marked as a sidecar's by the peer token
(``--peer-token-file``: only such a session may send a replica). Where the other sidecars
are comes from this sidecar's own configuration (:class:`ReplicaHosts`: ``--replica-hosts``),
never from a client: a client names a replica target by host id only, and the peer token
goes to no address a client chose. Each replica of
a step is one client stream (``Checkpoint.Receive``): a header naming it, the shards,
and a last message marked ``done``:

- **same machine** (the receiver's boot id is ours and its worker socket is here): maps
  the receiver's arena through that socket, as a Worker does, copies each shard into a
  block of it with one memcpy, and sends the blocks' ``ArenaRef``s: the receiver takes the
  blocks with no copy;
- **elsewhere**: sends each shard's bytes raw (a ``bytes`` field, no codec), in
  pieces of :data:`PIECE_BYTES`, copied once from the shard into the message; the receiver
  assembles them in blocks of its own arena.

The receiver counts only whole replicas (``done`` came): a stream cut short leaves none.
Each replica carries its tenant (the one this sidecar authenticated as the caller of
``Replicate``; none outside pools), which the receiver counts it against; a same-machine link
maps the receiver's arena as that tenant's (:func:`attach`).
:class:`Links` keeps one link per receiver and tenant from step to step: mapping a receiver's arena
costs about as much as copying a step's part into it. The receiver's side (the replicas it holds,
their eviction with the RAM tier) is ``replication.Replicator`` and ``ram_tier.RamTier``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from sidecar._src.arena import shm, worker as worker_lib
from sidecar._src.ckptfmt.records import AgreeState, ReplicaHeader, ReplicaTarget, Staged
from sidecar._src.core import address as address_lib, env as env_lib, errors, rendezvous
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.wire import checkpoint_wire as wire, ipc, protocol
from sidecar._src.wire.pbscan import encode_varint
from sidecar._src.wire.protocol import ckpt_pb, pb

# One piece of a shard sent inline. Small enough that the receiver's copy of one piece
# overlaps the sending of the next (flow control holds a message back until the receiver
# reads it), big enough that the per-message cost is lost in the copy. 512 MiB to a
# sidecar on loopback here (python -m benchmarks.replication --link): 64 MiB parts 3.2 s,
# 16 MiB 0.96 s, 8 MiB 0.85 s, 4 MiB 0.86 s; 4 unary calls of 16 MiB in flight (the
# codec path before the stream) 2.1-2.4 s.
PIECE_BYTES = 8 << 20
QUEUED = 4  # messages serialized ahead of the one gRPC sends
# Same-machine shards whose blocks one message hands over: the receiver takes each
# message's blocks as it comes.
BATCH_BYTES = 256 << 20
ARENA_WAIT_S = 10.0  # how long a full receiver arena is waited on
# A replica's whole stream: as long as a Replicate may wait (a paced or slow link takes
# long; a receiver that stops reading is found by the HTTP/2 pings, a cancel ends it at once).
SEND_TIMEOUT_S = 3600.0
WATCH_S = 0.5  # how often Links looks for target sidecars that exited
PACE_BYTES = 1 << 20  # with a bandwidth limit, the copy into a receiver's arena goes in pieces:
# small ones keep the pace smooth (2-4 ms of copy, then a sleep)
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.enable_http_proxy", 0),
)

log = logging.getLogger(__name__)


def replica_credentials(tls_cert: str | None, tls_key: str | None,
                     tls_client_ca: str | None) -> grpc.ChannelCredentials | None:
  """How a sidecar with TLS (``--tls-cert``) reaches the other sidecars: None without TLS.

  It trusts ``$SIDECAR_TLS_CA``, else its own ``--tls-client-ca`` (a job's sidecars
  have one CA), else the system's roots; for mTLS it presents
  ``$SIDECAR_TLS_CLIENT_CERT``/``_KEY``, else its own certificate (which must then allow
  client authentication, as the k8s component's one does).
  """
  if tls_cert is None or tls_key is None:
    return None
  mine = env_lib.get(env_lib.TLS_CLIENT_CERT) is None
  return protocol.tls_credentials(env_lib.get(env_lib.TLS_CA) or tls_client_ca,
                                  tls_cert if mine else None, tls_key if mine else None)


class ReplicaHosts:
  """The job's (or pool's) sidecars this one may send replicas to, by host id: entry ``i``
  of ``--replica-hosts`` is host ``i``'s gRPC address (``HOST:PORT`` or ``unix:PATH``).

  ``file``: a file holding that list instead (commas or newlines between entries), read
  each time a link is made: a launcher that learns the ports only once the sidecars run
  (``LocalCluster`` over TCP) writes it then; or a Slurm job's rendezvous directory, whose
  ``hosts/H.json`` entries the sidecars write as they serve (core/rendezvous.py). Only the
  sidecar's own configuration names these addresses; a client names a host id
  (``Replicate``'s ``hosts``).
  """

  def __init__(self, addresses: Sequence[str] = (), *, file: str | None = None):
    self._given = tuple(addresses)
    self._file = file
    if not file:
      self._parse(self._given, "--replica-hosts")

  @staticmethod
  def _parse(entries: Sequence[str], where: str) -> tuple[str, ...]:
    return tuple(address_lib.parse(e, what=f"{where} entry").target for e in entries)

  def addresses(self) -> dict[int, str]:
    """The configured addresses, by host id (the file read now, if there is one).

    Raises:
      InvalidArgumentError: the file cannot be read, or holds a malformed entry.
    """
    if not self._file:
      return dict(enumerate(self._parse(self._given, "--replica-hosts")))
    if os.path.isdir(self._file):  # a Slurm job's: each sidecar's entry, once it serves
      return {e.host_id: address_lib.Address(host=e.address, port=e.port).target
              for e in rendezvous.read_hosts(self._file)}
    try:
      with open(self._file, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise errors.InvalidArgumentError(
          f"cannot read --replica-hosts-file {self._file}: {e.strerror or e}") from None
    entries = [s.strip() for s in text.replace("\n", ",").split(",") if s.strip()]
    return dict(enumerate(self._parse(entries, f"--replica-hosts-file {self._file}")))

  def describe(self) -> str:
    """The configured hosts, for messages."""
    where = (f"--replica-hosts-file {self._file}" if self._file else "--replica-hosts")
    try:
      found = self.addresses()
    except errors.SidecarError as e:
      return f"{where}: {e}"
    if not found:
      return f"none ({where} is empty)"
    return f"{where}: " + ", ".join(f"host {i} {a}" for i, a in sorted(found.items()))

  def target(self, host_id: object, *, own: int) -> ReplicaTarget:
    """Host ``host_id``'s replica target, from the configured list.

    Raises:
      InvalidArgumentError: ``host_id`` is this sidecar's own, or not in the list; naming
        the value and the configured hosts.
    """
    found = self.addresses()
    if (not isinstance(host_id, int) or isinstance(host_id, bool) or host_id == own
        or host_id not in found):
      why = "is this sidecar itself" if host_id == own else "is not one of them"
      raise errors.InvalidArgumentError(
          f"replica target host {host_id!r} {why}: host {own} sends replicas only to the "
          f"job's other sidecars it was started with ({self.describe()}); name one of those "
          "host ids, or start the sidecars with --replica-hosts listing every sidecar of "
          "the job in host order (sidecar launch, LocalCluster and the k8s and Slurm "
          "launchers pass it)")
    return ReplicaTarget(host_id, found[host_id])


def attach(receiver: ReplicaTarget, socket_path: str, *, replica_token: str | None,
           tenant: str | None, timeout: float) -> worker_lib.Worker:
  """Maps a same-machine receiver's arena through its worker socket, as the sidecars' link.

  The attach proves the peer token and names the tenant whose replicas the blocks hold
  (``tenants.ReplicaAttach``): the receiver counts them against that tenant, in its memory. The
  one place a link attaches: where the receiver keeps an arena per tenant, this is where the
  tenant's is asked for.

  Raises:
    AuthenticationError, PermissionDeniedError: the receiver refused the sidecars' link.
  """
  token = (tenants_lib.ReplicaAttach(replica_token, tenant or "").token() if replica_token
           else None)  # no peer token: as a trainer's Worker (a shared token's sidecars)
  try:
    return worker_lib.Worker(socket_path, timeout=timeout, token=token)
  except (errors.AuthenticationError, errors.PermissionDeniedError) as e:
    raise type(e)(
        f"the sidecars' own replica link (host {receiver.host_id}'s worker socket {socket_path}, "
        f"for tenant {tenant or '(none)'}) was refused: {e}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class _Piece:
  """A ReceiveRequest of one ReplicaPart whose ``data`` is still a view of the shard."""
  head: ckpt_pb.ReplicaPart  # without data
  data: memoryview


_PIECE_FIELD = ckpt_pb.ReceiveRequest.DESCRIPTOR.fields_by_name["part"].number  # a wire name
_DATA_FIELD = ckpt_pb.ReplicaPart.DESCRIPTOR.fields_by_name["data"].number


def check_sender(tenancy: tenants_lib.Tenancy | None, session: str,
                 tenant: str | None) -> None:
  """That a replica whose blocks come over a receiver's worker ``session`` is for the tenant
  that session attached for (:class:`tenants.ReplicaAttach`): the blocks count against the
  attached tenant, the replica would be kept (and read, dropped) as the header's
  ``tenant``. A sending sidecar keeps one link per tenant (:class:`Links`).

  Raises:
    PermissionDeniedError: naming both tenants.
  """
  if not session or tenancy is None:
    return
  attached, named, pool = tenancy.of_worker(session), tenant, tenancy.pool
  if named is None and pool is not None and not pool.quotas and len(pool.tenants) == 1:
    named = pool.tenants[0].name  # the shared token's one tenant, as its links attach
  if attached != named:
    raise errors.PermissionDeniedError(
        f"Receive: the replica's header is for tenant {tenant!r:.100}, but its blocks come "
        f"over a worker session the sending sidecar attached for tenant {attached!r:.100}; "
        "a replica counts against the tenant its link attached for: send each tenant's "
        "replicas over that tenant's own link")


def _serialize(message: ckpt_pb.ReceiveRequest | _Piece) -> bytes:
  """A ReceiveRequest's wire bytes; a :class:`_Piece`'s with the shard's bytes copied once.

  Protobuf's own way copies them three times (into ``bytes``, into the message, into
  its serialization); here they go straight from the shard into the one ``bytes``
  gRPC sends: ``part`` (length-delimited) = the piece's other fields, then ``data``.
  """
  if not isinstance(message, _Piece):
    return message.SerializeToString()
  head = message.head.SerializeToString()
  data_key = encode_varint(_DATA_FIELD << 3 | 2) + encode_varint(message.data.nbytes)
  inner = len(head) + len(data_key) + message.data.nbytes
  return b"".join((encode_varint(_PIECE_FIELD << 3 | 2), encode_varint(inner), head, data_key,
                   message.data))


def _offer(ready: queue.Queue, item: bytes, call: grpc.Future,
           cancelled: Callable[[], bool] = lambda: False) -> bool:
  """Queues ``item`` for the stream ``call``, waiting for room; False if the call ended.

  Raises ClosedError if ``cancelled()`` turns true meanwhile (a receiver that stopped
  reading holds the sender here until then, not until the stream's deadline).
  """
  while not call.done():
    if cancelled():
      raise errors.ClosedError("the replication was cancelled")
    try:
      ready.put(item, timeout=0.1)
      return True
    except queue.Full:
      pass
  return False


class _Pace:
  """Sleeps so that the bytes counted go no faster than ``bandwidth`` per second."""

  def __init__(self, bandwidth: int | None):
    self._bandwidth, self._t0, self._sent = bandwidth, time.monotonic(), 0

  @property
  def limited(self) -> bool:
    return bool(self._bandwidth)

  def after(self, nbytes: int) -> None:
    if not self._bandwidth:
      return
    self._sent += nbytes
    ahead = self._t0 + self._sent / self._bandwidth - time.monotonic()
    if ahead > 0:
      time.sleep(ahead)


def _pin(receiver: ReplicaTarget, timeout: float
         ) -> tuple[ipc.Pinned | None, str, tuple[tuple[str, int], ...]]:
  """The pinned socket, gRPC target and channel options of a link to ``receiver``."""
  return ipc.pin_channel(receiver.address, _CHANNEL_OPTIONS, timeout=timeout, unreachable=(
      lambda e: errors.HostLostError(f"replica host {receiver.host_id} at {receiver.address}: "
                                     f"{e.strerror or e}", host_id=receiver.host_id)))


class ReplicaLink:
  """An authenticated connection from this sidecar to one other sidecar, the receiver of
  its replicas.

  ``same_machine`` says whether shards go through the receiver's arena mapped here.
  Close it (or use it as a context manager): that unmaps the receiver's arena.
  """

  def __init__(self, receiver: ReplicaTarget, *, token: str | None,
               replica_token: str | None = None, tenant: str | None = None,
               timeout: float = 30.0, shared_memory: bool = True,
               credentials: grpc.ChannelCredentials | None = None):
    self.receiver = receiver
    self.tenant = tenant  # whose replicas this link carries (None: no tenant's)
    # A receiver on a Unix socket: its server's user checked before the tokens go (ipc.Pinned)
    self._pin, target, options = _pin(receiver, timeout)
    self._channel = (grpc.insecure_channel(target, options=options) if credentials is None
                     else grpc.secure_channel(target, credentials, options=options))
    self._worker: worker_lib.Worker | None = None
    try:
      auth = ((protocol.AUTH_KEY, f"Bearer {token}"),) if token else ()
      handshake = self._channel.unary_unary(
          f"/{protocol.SERVICE}/Handshake",
          request_serializer=pb.HandshakeRequest.SerializeToString,
          response_deserializer=pb.HandshakeResponse.FromString)
      self._receive = self._channel.stream_unary(  # requests: bytes from _serialize
          f"/{protocol.CHECKPOINT_SERVICE}/Receive",
          response_deserializer=ckpt_pb.ReceiveResponse.FromString)
      self._agree = self._channel.unary_unary(
          f"/{protocol.CHECKPOINT_SERVICE}/Agree",
          request_serializer=ckpt_pb.AgreeState.SerializeToString,
          response_deserializer=ckpt_pb.AgreeState.FromString)
      try:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        reply = handshake(pb.HandshakeRequest(
            versions=protocol.local_versions(),
            client=f"sidecar pid {os.getpid()} on {socket.gethostname()} (replicas)"),
            timeout=timeout, metadata=auth + (
                ((protocol.REPLICA_KEY, f"Bearer {replica_token}"),) if replica_token else ()))
      except grpc.FutureTimeoutError:
        raise errors.HostLostError(
            f"replica host {receiver.host_id} at {receiver.address} did not answer within "
            f"{timeout:.3g} s", host_id=receiver.host_id) from None
      except grpc.RpcError as e:
        raise self._error(e) from None
      if reply.identity.host_id != receiver.host_id:
        raise errors.InvalidArgumentError(
            f"the sidecar at {receiver.address} is host {reply.identity.host_id}, not host "
            f"{receiver.host_id} as this sidecar's --replica-hosts says "
            f"(entry {receiver.host_id}); "
            "list the job's sidecars in host order")
      self._metadata = auth + ((protocol.SESSION_KEY, reply.session),)
      here = shm.boot_id()
      if (shared_memory and here and reply.identity.boot_id == here
          and os.path.exists(reply.worker_socket)):
        self._worker = attach(receiver, reply.worker_socket, replica_token=replica_token,
                              tenant=tenant, timeout=timeout)
    except BaseException:
      self.close()
      raise

  @property
  def same_machine(self) -> bool:
    return self._worker is not None

  def hung_up(self) -> bool:
    """Whether a same-machine receiver's sidecar has exited (its socket closed)."""
    return self._worker is not None and self._worker.hung_up()

  def _error(self, e: grpc.RpcError) -> errors.SidecarError:
    return protocol.error_from_rpc(e, host=self.receiver.address, host_id=self.receiver.host_id)

  def send(self, header: ReplicaHeader,
           shards: Sequence[Staged], *,
           cancelled: Callable[[], bool] = lambda: False, timeout: float = SEND_TIMEOUT_S,
           bandwidth: int | None = None) -> int:
    """Sends every shard, then marks the replica whole; returns the bytes sent.

    One ``Receive`` stream: the header, the shards, then ``done``. ``header`` names
    the replica (directory, step, final_dir, source host); ``bandwidth`` (bytes per second)
    paces the sending. Raises HostLostError if the receiver goes away, ClosedError if
    ``cancelled()`` turns true.
    """
    w = self._worker
    first = ckpt_pb.ReceiveRequest(
        header=wire.replica_header_to_pb(header, self.tenant),
        worker_session=w.session if w is not None else "")
    sent = [0]
    held: list[np.ndarray] = []  # the receiver's blocks we filled, until it has taken them
    make = self._shared if w is not None else self._inline
    # The messages are made and serialized here, on this (idle-class) thread, QUEUED ahead
    # of gRPC's thread that sends them: the copies overlap the sending, and yield the
    # CPU to the training step as the writes do.
    ready: queue.Queue = queue.Queue(maxsize=QUEUED)
    end = b""  # no message is empty: the header comes first

    def requests() -> Iterator[bytes]:
      while (item := ready.get()) != end:
        yield item

    call = self._receive.future(requests(), timeout=timeout, metadata=self._metadata)
    try:
      messages: Iterator[Any] = itertools.chain(
          [first], make(header, shards, cancelled, timeout, _Pace(bandwidth), sent, held),
          [ckpt_pb.ReceiveRequest(done=True)])
      for message in messages:
        if not _offer(ready, _serialize(message), call, cancelled):
          break  # the stream ended early: its error is the call's
      _offer(ready, end, call, cancelled)
      call.result()
    except grpc.RpcError as e:
      raise self._error(e) from None
    except BaseException:
      call.cancel()  # the receiver drops what came: not a whole replica
      raise
    finally:
      while True:  # gRPC's thread, if still waiting for a message, gets the end
        try:
          ready.get_nowait()
        except queue.Empty:
          break
      ready.put_nowait(end)
      held.clear()
    return sent[0]

  def agree(self, state: AgreeState, *, timeout: float) -> AgreeState:
    """This sidecar's ``state`` in the sidecars' agreement on a step, told to the receiver
    (``agreement.py``); its answer."""
    try:
      answer = self._agree(wire.agree_to_pb(state), timeout=timeout, metadata=self._metadata)
    except grpc.RpcError as e:
      raise self._error(e) from None
    return wire.agree_from_pb(answer, "AgreeState", sender=self.receiver.address)

  def _shared(self, header: ReplicaHeader, shards: Sequence[Staged],
              cancelled: Callable[[], bool], timeout: float, pace: _Pace, sent: list,
              held: list) -> Iterator[ckpt_pb.ReceiveRequest]:
    """Each shard copied into a block of the receiver's arena; the blocks' ``ArenaRef``s sent."""
    w = self._worker
    assert w is not None
    batch = ckpt_pb.ReceiveRequest()
    batch_bytes = 0
    for shard in shards:
      data = shard.data
      if cancelled():
        raise errors.ClosedError(f"the replication of {header.final_dir} was cancelled")
      # A full receiver arena fails the replica soon, not after the whole deadline.
      dst, ref = w.empty(data.shape, data.dtype, timeout=min(timeout, ARENA_WAIT_S))
      dst_bytes, src_bytes = (a.reshape(-1).view(np.uint8) for a in (dst, data))
      step = PACE_BYTES if pace.limited else max(dst.nbytes, 1)
      for a in range(0, dst.nbytes, step):  # memcpy, on this (idle-class) thread
        np.copyto(dst_bytes[a:a + step], src_bytes[a:a + step])
        pace.after(min(step, dst.nbytes - a))
      held.append(dst)
      block = batch.blocks.add(record=wire.record_to_pb(
          shard.record.with_crc32c_of(data)))
      block.data.CopyFrom(wire.arena_ref_to_pb(ref))
      batch_bytes += data.nbytes
      if batch_bytes >= BATCH_BYTES:
        yield batch
        sent[0] += batch_bytes
        batch, batch_bytes = ckpt_pb.ReceiveRequest(), 0
    if batch.blocks:
      yield batch
      sent[0] += batch_bytes

  def _inline(self, header: ReplicaHeader, shards: Sequence[Staged],
              cancelled: Callable[[], bool], timeout: float, pace: _Pace, sent: list,
              held: list) -> Iterator[_Piece]:
    """Each shard's bytes, raw, in parts of PIECE_BYTES."""
    for shard in shards:
      data = shard.data
      flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
      record = wire.record_to_pb(shard.record.with_crc32c_of(data))
      for offset in range(0, max(flat.nbytes, 1), PIECE_BYTES):
        if cancelled():
          raise errors.ClosedError(f"the replication of {header.final_dir} was cancelled")
        part = ckpt_pb.ReplicaPart(record=record, offset=offset)
        chunk = flat[offset:offset + PIECE_BYTES].data  # a view: _serialize copies it
        yield _Piece(part, chunk)
        pace.after(chunk.nbytes)
      sent[0] += flat.nbytes

  def close(self) -> None:
    """Unmaps the receiver's arena and closes the channel; idempotent."""
    if self._worker is not None:
      self._worker.close()
      self._worker = None
    self._channel.close()
    if self._pin is not None:
      self._pin.close()

  def __enter__(self) -> ReplicaLink:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


class Links:
  """One :class:`ReplicaLink` per receiver, kept from step to step; ``close()`` closes them.

  A link that fails is closed, and made once more if it had served an earlier step and
  the receiver still answers (it may have restarted at the same address, or expired the
  session). A thread closes the link of a same-machine receiver whose sidecar exits, so
  that this sidecar does not keep a dead receiver's arena mapped (its memory alive) until
  the next step needs that receiver.
  """

  def __init__(self, *, token: str | None, replica_token: str | None = None,
               shared_memory: bool = True, credentials: grpc.ChannelCredentials | None = None):
    self._token = token
    self._replica_token = replica_token  # marks our handshakes as a sidecar's replica link
    self._shared_memory = shared_memory
    self._credentials = credentials  # TLS to the receivers (peer_credentials), None: plaintext
    self._lock = threading.Lock()
    # By (receiver host id, tenant): a same-machine link maps the tenant's memory there.
    self._links: dict[tuple[int, str | None], tuple[ReplicaLink, threading.Lock]] = {}
    self._closed = threading.Event()
    self._watcher: threading.Thread | None = None

  def send(self, receiver: ReplicaTarget, header: ReplicaHeader,
           shards: Sequence[Staged], *, tenant: str | None = None,
           cancelled: Callable[[], bool] = lambda: False, timeout: float = SEND_TIMEOUT_S,
           bandwidth: int | None = None) -> tuple[int, bool]:
    """:meth:`ReplicaLink.send` over ``receiver``'s link for ``tenant`` (whose replica it is,
    as this sidecar authenticated it); returns (bytes, same machine)."""
    key = (receiver.host_id, tenant)
    while True:
      link, lock, fresh = self._get(receiver, tenant, timeout)
      with lock:
        try:
          return (link.send(header, shards, cancelled=cancelled, timeout=timeout,
                            bandwidth=bandwidth), link.same_machine)
        except BaseException as e:
          self._forget(key, link)
          link.close()
          if (fresh or cancelled() or not isinstance(e, Exception)
              or isinstance(e, errors.HostLostError)):  # a receiver gone stays gone
            raise
          log.info("the link to host %d failed (%s); making a new one", receiver.host_id, e)

  def _get(self, receiver: ReplicaTarget, tenant: str | None, timeout: float
           ) -> tuple[ReplicaLink, threading.Lock, bool]:
    key = (receiver.host_id, tenant)
    with self._lock:
      entry = self._links.get(key)
    if entry is not None and entry[0].receiver == receiver:
      return entry[0], entry[1], False
    if entry is not None:  # the receiver moved
      self._retire(key, *entry)
    link = ReplicaLink(receiver, token=self._token, replica_token=self._replica_token,
                       tenant=tenant, timeout=min(timeout, 30.0),
                       shared_memory=self._shared_memory, credentials=self._credentials)
    with self._lock:
      if self._closed.is_set():
        link.close()
        raise errors.ClosedError("this sidecar is stopping")
      old = self._links.get(key)
      lock = threading.Lock()
      self._links[key] = (link, lock)
      if link.same_machine and self._watcher is None:
        self._watcher = threading.Thread(target=self._watch, name="sidecar-replica-links",
                                         daemon=True)
        self._watcher.start()
    if old is not None:
      self._retire(key, *old)
    return link, lock, True

  def _forget(self, key: tuple[int, str | None], link: ReplicaLink) -> None:
    with self._lock:
      if self._links.get(key, (None,))[0] is link:
        del self._links[key]

  def _retire(self, key: tuple[int, str | None], link: ReplicaLink,
              lock: threading.Lock) -> None:
    self._forget(key, link)
    with lock:  # after a send in flight on it
      link.close()

  def _watch(self) -> None:
    while not self._closed.wait(WATCH_S):
      with self._lock:
        links = list(self._links.items())
      for key, (link, lock) in links:
        if link.hung_up():
          log.info("replica host %d exited: unmapping its arena", key[0])
          self._retire(key, link, lock)

  def close(self) -> None:
    """Stops the watcher and closes every link; idempotent."""
    self._closed.set()
    if self._watcher is not None and self._watcher is not threading.current_thread():
      self._watcher.join(5)
    with self._lock:
      links, self._links = list(self._links.items()), {}
    for key, (link, lock) in links:
      self._retire(key, link, lock)
