"""The controller: one client with the global view of every sidecar."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import jax

from sidecar._src import (
    codec,
    distributed,
    env,
    errors,
    interrupts,
    options as options_lib,
    protocol,
    shm,
    worker as worker_lib,
)
from sidecar._src.controller import arguments, discovery, display, feed as feed_lib, health
from sidecar._src.controller.checkpoint import Checkpointer
from sidecar._src.controller.checkpoint_client import CheckpointClient
from sidecar._src.controller.connection import Connection, HostInfo
from sidecar._src.controller.feed import Feed
from sidecar._src.controller.stream import Stream, open_stream as open_grpc_stream
from sidecar._src.protocol import pb

log = logging.getLogger(__name__)
_REJOIN_TIMEOUT_S = 0.5  # a lost host's sidecar asked whether it is back: its deadline


class State(enum.Enum):
  OPEN = "open"
  CLOSED = "closed"


def token_from_env() -> str | None:
  """``$SIDECAR_TOKEN``, else the content of ``$SIDECAR_TOKEN_FILE``, else None."""
  return env.token()


class Controller:
  """Handshakes every sidecar, then runs registered functions on them.

  Example::

    with sidecar.Controller(["10.0.0.1:8490", "10.0.0.2:8490"]) as ctl:
      print(ctl.hosts)
      results = ctl.call("normalize", args=(batch,), hosts=[0])

  Args:
    addresses: the sidecars' gRPC addresses (``host:port``).
    token: the sidecars' bearer token; default ``$SIDECAR_TOKEN`` or ``$SIDECAR_TOKEN_FILE``.
    timeout: default deadline in seconds of every call.
    connect_timeout: how long to wait for each sidecar to answer the handshake.
    workers: ``{host_id: Worker}`` for hosts whose arena this process maps. By default
      (``attach=True``) the controller attaches to every sidecar on this machine itself,
      so large arrays move through shared memory instead of the network.
    peers: the trainer processes of this job (default: those of ``jax.distributed``).
    peer_timeout: seconds a sidecar may stay silent (hung, SIGSTOPped) before what waits
      on it (a feed, a stream, a request of its worker) ends with HostLostError; default
      ``$SIDECAR_PEER_TIMEOUT`` or 30. A slow pipeline is no silence: its sidecar still
      answers the pings.
    tls_ca, tls_cert, tls_key: PEM files for TLS to the sidecars' control ports (``sidecar
      serve --tls-cert``): the CA that signed their certificates (default
      ``$SIDECAR_TLS_CA``, else the system's roots), and for mTLS (``--tls-client-ca``)
      this controller's certificate and key (``$SIDECAR_TLS_CLIENT_CERT``,
      ``$SIDECAR_TLS_CLIENT_KEY``). None given or set: plaintext.

  With one process that owns every device, this controller drives every host. Under
  ``jax.distributed`` with N processes (one per host, see ``sidecar.distributed``), each
  process's controller sees every sidecar but drives only its own host's data path:
  the sidecar at ``$SIDECAR_ADDRESS`` (or the one Worker in ``workers``). Every process
  then makes the same calls in the same order; ``call`` runs on the caller's own host
  unless ``hosts`` says otherwise.
  """

  def __init__(self, addresses: Sequence[str], *, token: str | None = None,
               timeout: float = 60.0, connect_timeout: float = 30.0,
               workers: Mapping[int, worker_lib.Worker] | None = None, attach: bool = True,
               peers: distributed.Peers | None = None, peer_timeout: float | None = None,
               tls_ca: str | None = None, tls_cert: str | None = None,
               tls_key: str | None = None):
    if isinstance(addresses, str) or not addresses:
      raise errors.InvalidArgumentError(
          f"addresses must be a non-empty list of 'host:port' strings, got {addresses!r}")
    if timeout <= 0:
      raise errors.InvalidArgumentError(f"timeout must be positive seconds, got {timeout!r}")
    self.timeout = timeout
    self.peer_timeout = env.peer_timeout(peer_timeout)
    self._credentials = protocol.tls_credentials(tls_ca, tls_cert, tls_key)
    self.state = State.OPEN
    token = token if token is not None else token_from_env()
    self._token = token  # a lost host's sidecar that comes back is reconnected with it
    self._map_arenas = attach  # and its arena mapped, if on this machine
    self._conns: dict[int, Connection] = {}
    self._workers: dict[int, worker_lib.Worker] = {}
    self._own_workers: list[worker_lib.Worker] = []
    self._peers = peers if peers is not None else distributed.peers()
    self._device_hosts: dict[int, int] = {}
    self._local_hosts: list[int] = []
    self._feeds = self._checkpointers = 0  # made so far: SPMD names for their agreements
    self._children: weakref.WeakSet = weakref.WeakSet()  # feeds, streams, checkpointers made
    self._lost: dict[int, str] = {}  # host id -> why it is lost
    self._lost_listeners: list[Callable[[int, str], None]] = []
    self._back_listeners: list[Callable[[int], None]] = []
    self._rejoin = False  # watch(rejoin=True): reconnect to lost hosts that come back
    self._refused: dict[int, str] = {}  # lost host -> why its returned sidecar was refused
    self._watch: health.HealthWatch | None = None
    self._lock = threading.Lock()
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max(4, len(addresses)), thread_name_prefix="sidecar-controller")
    try:
      self._connect(list(addresses), token, connect_timeout)
      if self.multiprocess:
        self._attach_own(workers or {})
      else:
        self._attach(workers or {}, attach)
        self._local_hosts = sorted(self._conns)
        self._device_hosts = {d: h.host_id for h in self.hosts for d in h.device_ids}
    except BaseException:
      self.close()
      raise

  @classmethod
  def from_env(cls, *, timeout: float = 300.0, **kwargs: Any) -> Controller:
    """Finds every sidecar of this job from the environment, then connects.

    On Kubernetes the manifests in ``k8s/`` set what this reads (JobSet name, slices,
    hosts per slice, ports); elsewhere ``SIDECAR_HOSTS=host[:port],...`` lists them.
    Waits up to ``timeout`` seconds for every sidecar to answer its health check, then
    raises DiscoveryError listing those that did not.
    """
    return cls(discovery.discover(timeout=timeout), **kwargs)

  def _connect(self, addresses: list[str], token: str | None, timeout: float) -> None:
    futures = [self._pool.submit(Connection, a, token=token, timeout=timeout,
                                 peer_timeout=self.peer_timeout,
                                 credentials=self._credentials) for a in addresses]
    conns, failures, refused = [], [], []
    for a, f in zip(addresses, futures):
      try:
        conns.append(f.result())
      except errors.SidecarError as e:
        failures.append(e)
        if isinstance(e, errors.AuthenticationError):
          refused.append(a)
    if failures:
      for c in conns:
        c.close()
      if refused and conns:  # some took the token: sidecars of two jobs (or a stale token)
        raise errors.AuthenticationError(
            f"these sidecars are not of one job: {', '.join(c.address for c in conns)} "
            f"accepted this controller's token, {', '.join(refused)} refused it. List only "
            "one job's sidecars, with that job's token (token=..., SIDECAR_TOKEN or "
            "SIDECAR_TOKEN_FILE)")
      if len(failures) == 1:
        raise failures[0]
      raise type(failures[0])("; ".join(str(e) for e in failures))
    for c in conns:
      if c.info.host_id in self._conns:
        other = self._conns[c.info.host_id].address
        raise errors.InvalidArgumentError(
            f"sidecars {other} and {c.address} both say they are host {c.info.host_id}; "
            "give each sidecar its own --host-id (or are they of two jobs, or two "
            "LocalClusters? list one job's sidecars only)")
      self._conns[c.info.host_id] = c
    fingerprints = {c.info.registry_fingerprint for c in conns}
    if len(fingerprints) > 1:
      lines = [f"host {c.info.host_id} ({c.address}): functions {list(c.info.functions)}, "
               f"pipelines {list(c.info.pipelines)}, fingerprint {c.info.registry_fingerprint}"
               for c in conns]
      raise errors.VersionMismatchError(
          "the sidecars registered different code (are they of two jobs?); deploy the same "
          "modules to every host:\n  " + "\n  ".join(lines))

  def _attach(self, workers: Mapping[int, worker_lib.Worker], attach: bool) -> None:
    for host_id, w in workers.items():
      if host_id not in self._conns:
        raise errors.InvalidArgumentError(
            f"workers names host {host_id}, but the sidecars are hosts {sorted(self._conns)}")
      self._workers[host_id] = w
    if not attach:
      return
    for host_id, c in self._conns.items():
      mine = None if host_id in self._workers else self._local_worker(c)
      if mine is not None:
        self._own_workers.append(mine)
        self._workers[host_id] = mine

  def _local_worker(self, conn: Connection) -> worker_lib.Worker | None:
    """A new Worker of ``conn``'s sidecar if it runs on this machine, else None."""
    here, sock = shm.boot_id(), conn.reply.worker_socket
    if not here or conn.reply.identity.boot_id != here or not os.path.exists(sock):
      return None
    return worker_lib.Worker(sock, timeout=self.peer_timeout)

  def _attach_own(self, workers: Mapping[int, worker_lib.Worker]) -> None:
    """N processes: attaches to this process's own sidecar; learns every process's host."""
    if len(workers) > 1:
      raise errors.InvalidArgumentError(
          f"in a job of {self._peers.count} processes each process drives one host; "
          f"workers names hosts {sorted(workers)}: pass at most one")
    if workers:
      (host_id, w), = workers.items()
    else:
      if not env.get(env.ADDRESS):
        raise errors.InvalidArgumentError(
            f"process {self._peers.index} of {self._peers.count} does not know its own "
            f"sidecar: set {env.ADDRESS}=unix:///path/to/sidecar.sock (sidecar "
            "launch and the k8s manifests do), or pass workers={host_id: Worker(...)}")
      try:
        w = worker_lib.Worker(timeout=self.peer_timeout)
      except errors.HostLostError as e:
        raise errors.DiscoveryError(
            f"process {self._peers.index}: its own sidecar at "
            f"{env.get(env.ADDRESS)} is unreachable: {e}") from None
      self._own_workers.append(w)
      host_id = w.host_id
    if host_id not in self._conns:
      raise errors.DiscoveryError(
          f"process {self._peers.index}'s own sidecar is host {host_id} ({w.path}), which is "
          f"not among the sidecars this controller reached (hosts {sorted(self._conns)}); "
          "list it in SIDECAR_HOSTS")
    self._workers[host_id] = w
    self._local_hosts = [host_id]
    mine = {"host_id": host_id, "device_ids": [d.id for d in jax.local_devices()]}
    everyone = self._peers.all_gather("controller/hosts", json.dumps(mine))
    self._device_hosts = distributed.hosts_by_process([json.loads(v) for v in everyone])
    for h, c in self._conns.items():  # what each host's trainer said, not what its sidecar
      c.info = dataclasses.replace(c.info, device_ids=tuple(  # knew at the handshake
          sorted(d for d, owner in self._device_hosts.items() if owner == h)))

  # ---- introspection -----------------------------------------------------

  @property
  def multiprocess(self) -> bool:
    """Whether this is one of several trainer processes, each driving its own host."""
    return self._peers.count > 1

  @property
  def peers(self) -> distributed.Peers:
    """This job's trainer processes, for agreements of your own (``all_gather``,
    ``broadcast``, ``agree``); with one process, trivially itself."""
    return self._peers

  @property
  def process_index(self) -> int:
    """This trainer process's index in the job (0 with one process)."""
    return self._peers.index

  @property
  def local_hosts(self) -> list[int]:
    """The live hosts this process drives: all of them, or its own under N processes."""
    return [h for h in self._local_hosts if h not in self._lost]

  @property
  def device_hosts(self) -> dict[int, int]:
    """``{global device id: host id}`` for every device of the job."""
    return dict(self._device_hosts)

  @property
  def hosts(self) -> list[HostInfo]:
    """Every live sidecar's identity, by host id (lost hosts are dropped)."""
    return [self._conns[h].info for h in sorted(self._conns) if h not in self._lost]

  @property
  def lost_hosts(self) -> dict[int, str]:
    """``{host id: why}`` of the hosts found lost (see :meth:`watch`)."""
    with self._lock:
      return dict(self._lost)

  def watch(self, *, interval: float = health.DEFAULT_INTERVAL_S,
            lost_after: float = health.DEFAULT_LOST_AFTER_S, rejoin: bool = False) -> None:
    """Polls every live host's health; one silent for ``lost_after`` s is lost.

    A lost host leaves :attr:`hosts`; the feeds and streams this controller made are
    closed (their ``next()`` raises instead of waiting on a host that will not answer),
    its arena is unmapped here once no array reads it, and the listeners added with
    :meth:`on_host_lost` are told. With ``rejoin=True`` a lost host is asked every
    second whether its sidecar is back (a new one at the same address, with the same
    registered code): then it is reconnected, rejoins :attr:`hosts` with an empty
    arena, and the listeners added with :meth:`on_host_back` are told. Idempotent.
    """
    self._check_open()
    with self._lock:
      self._rejoin = self._rejoin or rejoin
      if self._watch is not None:
        return
      rpcs = {h: (c.status_rpc, c.metadata) for h, c in self._conns.items()
              if h not in self._lost}
      self._watch = health.HealthWatch(rpcs, on_lost=self._host_lost, interval=interval,
                                       lost_after=lost_after, rejoin=self._host_back)
      self._watch.start()

  def on_host_lost(self, listener: Callable[[int, str], None]) -> None:
    """Calls ``listener(host_id, reason)`` (on the watch's thread) when a host is lost."""
    self._lost_listeners.append(listener)

  def on_host_back(self, listener: Callable[[int], None]) -> None:
    """Calls ``listener(host_id)`` (on the watch's thread) when a lost host rejoins."""
    self._back_listeners.append(listener)

  def _host_lost(self, host_id: int, reason: str) -> None:
    with self._lock:
      if host_id in self._lost or self.state is State.CLOSED:
        return
      self._lost[host_id] = reason
      worker = self._workers.pop(host_id, None)
    self.cancel()
    if worker is not None and worker in self._own_workers:
      self._own_workers.remove(worker)
      worker.close()  # unmaps the dead sidecar's arena once no array reads it
    for listener in list(self._lost_listeners):
      listener(host_id, reason)

  def _host_back(self, host_id: int) -> tuple[Any, tuple] | None:
    """Reconnects to lost host ``host_id`` if ``rejoin`` is on and its sidecar answers
    again; returns its Status call and metadata for the watch, else None."""
    if not self._rejoin or self.state is State.CLOSED:
      return None
    old = self._conns[host_id]
    try:
      conn = Connection(old.address, token=self._token, timeout=_REJOIN_TIMEOUT_S,
                        peer_timeout=self.peer_timeout, credentials=self._credentials)
    except errors.SidecarError:
      return None  # still gone
    refused = None
    if conn.info.host_id != host_id:
      refused = f"the sidecar at {old.address} is now host {conn.info.host_id}"
    elif conn.info.registry_fingerprint != old.info.registry_fingerprint:
      refused = (f"its sidecar registered different code (fingerprint "
                 f"{conn.info.registry_fingerprint}, was {old.info.registry_fingerprint}); "
                 "deploy the same modules to every host")
    worker = None
    if refused is None and self._map_arenas and not self.multiprocess:
      try:  # as _attach did at the start
        worker = self._local_worker(conn)
      except errors.SidecarError as e:
        refused = f"its arena could not be mapped: {e}"
    if refused is not None:
      conn.close()
      if self._refused.get(host_id) != refused:
        self._refused[host_id] = refused
        log.warning("host %d answers again but stays lost: %s", host_id, refused)
      return None
    with self._lock:
      if self.state is State.CLOSED:
        conn.close()
        if worker is not None:
          worker.close()
        return None
      self._conns[host_id] = conn
      if worker is not None:
        self._workers[host_id] = worker
        self._own_workers.append(worker)
      if not self.multiprocess and conn.info.device_ids:
        self._device_hosts.update({d: host_id for d in conn.info.device_ids})
      del self._lost[host_id]
      self._refused.pop(host_id, None)
    old.close()
    log.info("host %d is back (%s, pid %d)", host_id, conn.address, conn.info.pid)
    for listener in list(self._back_listeners):
      listener(host_id)
    return conn.status_rpc, conn.metadata

  def cancel(self) -> None:
    """Closes every feed and stream this controller made: work in flight stops."""
    for child in list(self._children):
      if not isinstance(child, Checkpointer):
        child.close()

  def worker(self, host_id: int) -> worker_lib.Worker | None:
    """The worker that maps host ``host_id``'s arena here, if any."""
    return self._workers.get(host_id)

  def _check_open(self) -> None:
    if self.state is State.CLOSED:
      raise errors.ClosedError("this Controller is closed; make a new one")

  def _select(self, hosts: Sequence[int] | None) -> list[int]:
    if hosts is None:
      return self.local_hosts
    if isinstance(hosts, int):
      hosts = [hosts]
    chosen = list(hosts)
    lost = [h for h in chosen if h in self._lost]
    if lost:
      raise errors.HostLostError(
          f"hosts {lost} are lost ({'; '.join(self._lost[h] for h in lost)}); live hosts: "
          f"{[h.host_id for h in self.hosts]}", host_id=lost[0])
    bad = [h for h in chosen if h not in self._conns]
    if bad or not chosen or len(set(chosen)) != len(chosen):
      raise errors.InvalidArgumentError(
          f"hosts={list(hosts)!r} is not a valid placement: hosts must be distinct ids among "
          f"{sorted(self._conns)}" + (f"; unknown: {bad}" if bad else ""))
    return chosen

  # ---- calls -------------------------------------------------------------

  @interrupts.deferring  # Ctrl-C: the call's result, when it comes, is dropped
  def call(self, name: str, /, *legacy_args: Any, args: Sequence[Any] = (),
           kwargs: Mapping[str, Any] | None = None, hosts: Sequence[int] | None = None,
           timeout: float | None = None, **legacy_kwargs: Any) -> list[Any]:
    """Runs registered function ``name`` on ``hosts`` concurrently.

    The function gets ``*args`` and ``**kwargs``; they are the user's alone, so a
    parameter named ``timeout`` or ``hosts`` goes in ``kwargs`` like any other.

    Example::

      ctl.call("normalize", args=(batch,), kwargs={"timeout": 5.0}, hosts=[0], timeout=30)

    Args:
      name: a registered ``@sidecar.function``.
      args: the function's positional arguments (pytrees of arrays, scalars, str, bytes).
      kwargs: the function's keyword arguments.
      hosts: host ids to run it on; default every host, or under N processes this
        process's own host (so N processes calling it run it once per host in all).
      timeout: seconds each host is given; default the controller's.
      *legacy_args: deprecated shorthand for ``args``, with a DeprecationWarning.
      **legacy_kwargs: deprecated shorthand for ``kwargs``, with a DeprecationWarning.

    Returns:
      The results in the order of ``hosts`` (by default, of host id).

    Raises:
      RemoteError: the function raised. HostLostError: a sidecar died.
    """
    self._check_open()
    args, kwargs = arguments.split_legacy("call", name, args, kwargs, legacy_args, legacy_kwargs)
    chosen = self._select(hosts)
    timeout = self.timeout if timeout is None else timeout
    if len(chosen) == 1:  # No thread hop: the common single-host call stays on this thread.
      return [self._call_sync(chosen[0], name, args, kwargs, timeout)]
    futures = [self._call_one(h, name, args, kwargs, timeout) for h in chosen]
    return [interrupts.wait(f) for f in futures]

  def _request(self, host_id: int, name: str, args: tuple, kwargs: dict, timeout: float,
               held: list) -> pb.CallRequest:
    if not isinstance(name, str):
      raise errors.InvalidArgumentError(f"name must be a str, got {name!r}")
    w = self._workers.get(host_id)
    to_arena = None
    if w is not None:
      def to_arena(a):
        ref = w.ref_of(a)
        if ref is not None:  # already in the arena: send the descriptor only
          held.append(a)
          return ref
        dst, ref = w.put(a, timeout=timeout)
        held.append(dst)  # This side holds argument blocks until the call ends.
        return ref
    return pb.CallRequest(
        name=name, args=codec.encode(tuple(args), to_arena=to_arena, where="args"),
        kwargs=codec.encode(dict(kwargs), to_arena=to_arena, where="kwargs"),
        worker_session=w.session if w is not None else "")

  def _decode(self, host_id: int, name: str, response: pb.CallResponse) -> Any:
    w = self._workers.get(host_id)
    return codec.decode(response.result, from_arena=w.view if w else None,
                        where=f"result of {name!r} from host {host_id}")

  def _call_sync(self, host_id: int, name: str, args: tuple, kwargs: dict, timeout: float) -> Any:
    conn, held = self._conns[host_id], []
    deadline = time.monotonic() + timeout
    request = self._request(host_id, name, args, kwargs, timeout, held)
    if not conn.calls.enter(deadline - time.monotonic()):
      held.clear()
      raise conn.calls.waited_too_long(f"call {name!r} on host {host_id}", timeout)
    leave = True  # give the window's slot back here (not when a call outlives Ctrl-C)
    try:
      left = max(deadline - time.monotonic(), 0.0)
      if threading.current_thread() is not threading.main_thread():
        response = conn.call_rpc(request, timeout=left, metadata=conn.metadata)
      else:  # a future, which Ctrl-C can leave; a blocking call would hold it off to the end
        rpc = conn.call_rpc.future(request, timeout=left, metadata=conn.metadata)
        try:
          response = interrupts.wait(rpc)
        except KeyboardInterrupt:
          # The call goes on (within its deadline), holding its arguments' blocks; what
          # it returns is dropped then, so its result's blocks go back too.
          kept, leave = list(held), False
          rpc.add_done_callback(lambda f: self._drop(host_id, name, f, kept, conn))
          raise
    except grpc.RpcError as e:
      raise protocol.error_from_rpc(e, host=conn.address, host_id=host_id) from None
    except ValueError:
      if conn.calls.closed:  # gRPC's "Channel closed!": the controller closed meanwhile
        raise errors.ClosedError(f"call {name!r} on host {host_id}: the connection "
                                 "closed") from None
      raise
    finally:
      held.clear()
      if leave:
        conn.calls.exit()
    return self._decode(host_id, name, response)

  def _drop(self, host_id: int, name: str, rpc: grpc.Future, held: list,
            conn: Connection) -> None:
    """Decodes and drops the result of a call nobody waits for: its blocks go back."""
    conn.calls.exit()
    held.clear()
    try:
      self._decode(host_id, name, rpc.result())
    except Exception:  # the caller is gone; its error has nobody to reach
      pass

  def stream(self, name: str, /, *legacy_args: Any, args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None, host: int | None = None,
             prefetch: int = 2, timeout: float | None = None, device: jax.Device | None = None,
             **legacy_kwargs: Any) -> Stream:
    """Iterates what registered function ``name(*args, **kwargs)`` returns (an iterable).

    ``host`` defaults to the first host this process drives (its own under N processes).

    The sidecar runs at most ``prefetch`` items ahead of this consumer. When this
    process maps that host's arena, items come over its Unix socket (the fast
    path); otherwise over gRPC, with arrays inline. With ``device``, arrays
    arrive as ``jax.Array``s on it (from the arena with no copy on the CPU backend).
    ``timeout`` bounds the wait for each item: past it ``next()`` raises
    DeadlineExceededError and the stream stays open.
    ``*legacy_args``/``**legacy_kwargs``: the deprecated shorthand for ``args``/``kwargs``.

    Example::

      with ctl.stream("batches", kwargs={"split": "train"}, host=0, prefetch=4) as s:
        for batch in s:
          ...
    """
    self._check_open()
    args, kwargs = arguments.split_legacy("stream", name, args, kwargs, legacy_args,
                                          legacy_kwargs, stacklevel=3)
    (host_id,) = self._select([(self.local_hosts or self._local_hosts)[0] if host is None
                               else host])
    held = []
    request = self._request(host_id, name, args, kwargs, self.timeout, held)
    return self._open_stream(host_id, request, prefetch=prefetch, timeout=timeout, held=held,
                             device=device)

  def _open_stream(self, host_id: int, request: pb.CallRequest, *, prefetch: int,
                   timeout: float | None, held: list, device: jax.Device | None = None
                   ) -> Stream:
    conn, w = self._conns[host_id], self._workers.get(host_id)
    if w is not None:
      stream = w.open_stream(request, prefetch=prefetch, timeout=timeout, device=device)
    else:
      stream = open_grpc_stream(conn.stream_rpc, request, prefetch=prefetch,
                                metadata=conn.metadata, timeout=timeout, host=conn.address,
                                host_id=host_id, device=device)
    stream.args = held  # Argument blocks live as long as the stream.
    self._children.add(stream)
    return stream

  def feed(self, name: str, /, *, global_batch_size: int, sharding: jax.sharding.Sharding,
           kwargs: Mapping[str, Any] | None = None, seed: int = 0,
           num_epochs: int | None = None, state: dict[str, Any] | None = None,
           options: options_lib.FeedOptions | None = None, **legacy_kwargs: Any) -> Feed:
    """Global batches of registered pipeline ``name``, laid out by ``sharding``.

    Each host's sidecar runs the pipeline and produces the rows its devices own;
    they arrive through its arena. Iterating yields pytrees of global ``jax.Array``s.
    The batches depend only on ``name``, ``kwargs``, ``seed`` and the batch index;
    ``options`` say how they are produced.

    Example::

      mesh = jax.sharding.Mesh(jax.devices(), ("data",))
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
      with ctl.feed("digits", global_batch_size=64, sharding=sharding,
                    kwargs={"split": "train"}) as feed:
        for batch in feed:
          state = train_step(state, batch)
        saved = feed.state()  # resume with ctl.feed(..., state=saved)

    Args:
      name: a registered ``@sidecar.pipeline``.
      global_batch_size: rows of every global batch, split among hosts by ``sharding``.
      sharding: how the batch dimension lies over this process's devices.
      kwargs: the pipeline's own arguments (a parameter named ``seed`` goes here too).
      seed: shuffling seed (for pipelines that return a ``grain.MapDataset``).
      num_epochs: epochs to run; None repeats forever.
      state: a ``feed.state()`` to resume after.
      options: ``sidecar.FeedOptions``: prefetch depth, worker processes.
      **legacy_kwargs: deprecated: ``prefetch=``/``workers=`` for ``options``, anything
        else for ``kwargs``; each with a DeprecationWarning.
    """
    self._check_open()
    kwargs, old_options = arguments.split_legacy_feed(
        name, kwargs, options, legacy_kwargs,
        [f.name for f in dataclasses.fields(options_lib.FeedOptions)])
    if options is None:
      try:
        options = options_lib.FeedOptions(**old_options)
      except ValueError as e:
        raise errors.InvalidArgumentError(str(e)) from None
    if not isinstance(options, options_lib.FeedOptions):
      raise errors.InvalidArgumentError(
          f"options must be a sidecar.FeedOptions, got {type(options).__name__}")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
      raise errors.InvalidArgumentError(
          f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
      raise errors.InvalidArgumentError(f"num_epochs must be None or >= 1, got {num_epochs!r}")
    prefetch, workers = options.prefetch, options.workers
    missing = [h.host_id for h in self.hosts if name not in h.pipelines]
    if missing:
      raise errors.NotRegisteredError(
          f"no pipeline named {name!r} is registered on hosts {missing}; registered pipelines: "
          f"{', '.join(self.hosts[0].pipelines) or '(none)'}")
    plans = feed_lib.plan(sharding, global_batch_size, self._device_hosts)
    encoded, no_args = codec.encode(dict(kwargs), where="kwargs"), codec.encode(())
    self._feeds += 1
    key = f"feed/{self._feeds}"
    self._peers.agree(f"{key}/open", {
        "pipeline": name, "global_batch_size": global_batch_size, "seed": seed,
        "num_epochs": num_epochs, "workers": workers, "state": state,
        "kwargs": hashlib.sha256(encoded.SerializeToString(deterministic=True)).hexdigest()[:16],
        "mesh": [[d.id for d in ds] for p in plans for ds in p.devices]},
        what=f"the arguments of feed {self._feeds} ({name!r})")

    def open_stream(host_id: int, spec: pb.FeedSpec):
      w = self._workers.get(host_id)
      request = pb.CallRequest(name=name, args=no_args, kwargs=encoded, feed=spec,
                               worker_session=w.session if w is not None else "")
      return self._open_stream(host_id, request, prefetch=prefetch, timeout=None, held=[])

    feed = Feed(name=name, plans=plans, sharding=sharding, global_batch_size=global_batch_size,
                seed=seed, num_epochs=num_epochs, prefetch=prefetch, state=state,
                workers=workers, open_stream=open_stream, local_hosts=self.local_hosts,
                peers=self._peers, key=key,
                arena_use=lambda: {s.identity.host_id: s.arena_used / max(s.arena_size, 1)
                                   for s in self.status()})
    self._children.add(feed)
    return feed

  def checkpointer(self, directory: str, *, max_to_keep: int | None = None,
                   keep_period: int | None = None, ram_steps: int = 1,
                   ram_budget: int | None = None, if_busy: str = "wait",
                   sweep: bool = True, replicas: int = 0,
                   replica_bandwidth: int | str | None = None) -> Checkpointer:
    """Checkpoints that stall the trainer for one copy into shared memory.

    The sidecars persist each step in stock Orbax's layout (``ocp.CheckpointManager``
    restores it), commit it across hosts, and keep the newest ``ram_steps`` committed
    steps in their arenas (within ``ram_budget`` bytes) so a restore need not read
    storage.

    Example::

      ckpt = ctl.checkpointer("/ckpt/run1", max_to_keep=3)
      handle = ckpt.save(step, {"params": params, "opt": opt_state}, data_state=feed.state())
      handle.staged.result()    # the arrays may be changed or donated from here on
      ...
      state = ckpt.restore(target=abstract_state)

    ``sweep=False`` leaves uncommitted steps alone (where an Orbax manager owns them).

    With ``replicas=R`` (at most hosts - 1: fewer live hosts get fewer, with a warning),
    once a step is staged each sidecar sends its
    shards to R peer sidecars (another slice's first, else the next hosts), sidecar to
    sidecar, in the background: ``handle.replicated`` resolves once every shard has its
    copies. Replicas count toward ``ram_budget`` and leave with their step. A restore
    then takes each shard from any live copy, storage last, so losing a host loses no
    step the RAM tiers hold (``ckpt.last_restore_stats()`` says where shards came from).
    ``replica_bandwidth`` (bytes per second per sidecar, or a size such as ``"500MiB"``)
    paces the sending, to leave the training step its cores, memory bandwidth or network.

    Raises:
      InvalidArgumentError: ``directory`` is not writable from every sidecar.
    """
    self._check_open()
    self._checkpointers += 1
    ckpt = Checkpointer(
        directory=str(directory), client=self._checkpoint_client(),
        hosts=[h.host_id for h in self.hosts], device_hosts=self._device_hosts,
        max_to_keep=max_to_keep, keep_period=keep_period, ram_steps=ram_steps,
        ram_budget=ram_budget, if_busy=if_busy, sweep=sweep, local_hosts=self.local_hosts,
        peers=self._peers, key=f"ckpt/{self._checkpointers}", replicas=replicas,
        replica_bandwidth=replica_bandwidth,
        sidecars={h: {"address": c.address, "socket": c.reply.worker_socket,
                      "boot_id": c.reply.identity.boot_id, "slice_id": c.info.slice_id}
                  for h, c in self._conns.items() if h not in self._lost},
        mapped=sorted(h for h in self._workers if h not in self._lost))
    self._children.add(ckpt)
    return ckpt

  def _checkpoint_client(self) -> CheckpointClient:
    """The checkpoint phases on these sidecars, through this controller's channels."""
    return CheckpointClient(select=self._select, connection=self._conns.__getitem__,
                            worker=self._workers.get, status=self.status, timeout=self.timeout)

  @interrupts.deferring
  def call_async(self, name: str, /, *legacy_args: Any, args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None, hosts: Sequence[int] | None = None,
                 timeout: float | None = None, **legacy_kwargs: Any
                 ) -> list[concurrent.futures.Future]:
    """Like :meth:`call`, but returns one ``concurrent.futures.Future`` per host."""
    self._check_open()
    args, kwargs = arguments.split_legacy("call_async", name, args, kwargs, legacy_args,
                                          legacy_kwargs)
    timeout = self.timeout if timeout is None else timeout
    return [self._call_one(h, name, args, kwargs, timeout) for h in self._select(hosts)]

  def _call_one(self, host_id: int, name: str, args: tuple, kwargs: dict,
                timeout: float) -> concurrent.futures.Future:
    conn, held = self._conns[host_id], []
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
      request = self._request(host_id, name, args, kwargs, timeout, held)
    except Exception as e:
      out.set_exception(e)
      return out

    def done(f: grpc.Future) -> None:
      held.clear()
      try:
        out.set_result(self._decode(host_id, name, f.result()))
      except grpc.RpcError as e:
        out.set_exception(protocol.error_from_rpc(e, host=conn.address, host_id=host_id))
      except Exception as e:
        out.set_exception(e)

    def fail(e: BaseException) -> None:
      held.clear()
      out.set_exception(e)

    conn.calls.call(  # the wait for a slot counts toward the timeout
        lambda left: conn.call_rpc.future(request, timeout=left, metadata=conn.metadata),
        done=done, fail=fail, timeout=timeout, what=f"call {name!r} on host {host_id}")
    return out

  @interrupts.deferring
  def status(self, *, timeout: float | None = None) -> list[pb.StatusResponse]:
    """Each sidecar's status (identity, registry, arena use, uptime), by host id.

    Asks every host at once; ``timeout`` (default: the controller's) bounds each.
    """
    self._check_open()
    out = []
    for h, c, s in self._statuses(self.timeout if timeout is None else timeout):
      if isinstance(s, grpc.RpcError):
        raise protocol.error_from_rpc(s, host=c.address, host_id=h) from None
      out.append(s)
    return out

  def _statuses(self, timeout: float) -> list[tuple[int, Connection, Any]]:
    """``(host, connection, status or grpc.RpcError)`` of every live host, asked at once."""
    calls = [(h, self._conns[h]) for h in sorted(set(self._conns) - set(self._lost))]
    futures = [c.status_rpc.future(pb.StatusRequest(), timeout=timeout, metadata=c.metadata)
               for _, c in calls]
    out = []
    for (h, c), f in zip(calls, futures):
      try:
        out.append((h, c, interrupts.wait(f)))
      except grpc.RpcError as e:
        out.append((h, c, e))
    return out

  # ---- display -----------------------------------------------------------

  @interrupts.deferring
  def _display_rows(self) -> list[display.Row]:
    if self.state is State.CLOSED:
      return []
    rows: list[display.Row] = []
    for h, c, s in self._statuses(display.STATUS_TIMEOUT_S):
      if isinstance(s, grpc.RpcError):
        s = protocol.error_from_rpc(s, host=c.address, host_id=h)
      rows.append((h, c.address, s))
    return rows

  def _display_facts(self) -> list[tuple[str, str]]:
    children = list(self._children)
    feeds = [c for c in children if isinstance(c, Feed) and c.status is feed_lib.State.OPEN]
    ckpts = [c for c in children if isinstance(c, Checkpointer) and not c._closed]
    facts = [("state", self.state.value),
             ("hosts", f"{len(self.hosts)} live" + (f", lost: {self.lost_hosts}"
                                                    if self._lost else "")),
             ("this process", f"{self.process_index} of {self._peers.count}, drives hosts "
                              f"{self.local_hosts}"),
             ("feeds open", ", ".join(repr(f.name) for f in feeds) or "none"),
             ("checkpointers", ", ".join(c.directory for c in ckpts) or "none")]
    return facts

  def __repr__(self) -> str:
    rows = self._display_rows()
    table = display.text_table(display.HOST_HEADER, display.host_rows(rows)) if rows else ""
    return display.text_block("sidecar.Controller", self._display_facts(), table)

  def _repr_html_(self) -> str:
    rows = self._display_rows()
    table = display.html_table(display.HOST_HEADER, display.host_rows(rows)) if rows else ""
    return display.html_block("sidecar.Controller", self._display_facts(), table)

  # ---- lifecycle ---------------------------------------------------------

  def close(self) -> None:
    """Closes what this controller made (feeds and streams, then checkpointers, which
    finish the save in flight), its workers and channels; idempotent."""
    if self.state is State.CLOSED:
      return
    if self._watch is not None:
      self._watch.stop()
    self.cancel()
    for child in list(self._children):
      child.close()  # the checkpointers: each waits for its save in flight
    self.state = State.CLOSED
    for w in self._own_workers:
      w.close()
    for c in self._conns.values():
      c.close()
    self._pool.shutdown(wait=False)

  def __enter__(self) -> Controller:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
