"""Which sidecars a Controller reaches: connecting, attaching workers, lost and back."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from sidecar._src.arena import shm, worker as worker_lib
from sidecar._src.controller import discovery
from sidecar._src.controller.connection import LEAVE_S, Connection, HostInfo
from sidecar._src.controller.framework import Framework, NumpyArrays
from sidecar._src.controller.peers import Peers, hosts_by_process, processes_by_host
from sidecar._src.core import env as env_lib, errors, interrupts
from sidecar._src.streams import grpc_transport, socket_transport
from sidecar._src.streams.consumer import Stream, ToDevice
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
REJOIN_TIMEOUT_S = 0.5  # a lost host's sidecar asked whether it is back: its deadline


class Sidecars:
  """One Controller's sidecars by host id: connections, workers, and which are lost.

  Owns every connection and the workers it made itself (not those it was given);
  :meth:`close` closes them. ``connect(address, timeout)`` makes a handshaken
  :class:`Connection`: the seam that a test fakes.

  Args:
    connect: makes a Connection to ``address``, waiting at most ``timeout`` seconds.
    peers: this job's trainer processes; with more than one, this process drives
      only its own host.
    silence_timeout: what the workers made here wait on a silent sidecar, in seconds.
    map_arenas: whether to attach to the sidecars on this machine (one process only).
    cancel: closes the feeds and streams in flight; called when a host is lost,
      before its worker is closed.
    framework: makes the workers, and says which devices this process owns.
    token: the token the workers made here present at attach (a pool's sidecar asks for
      their tenant's); None: each Worker's own default, ``$SIDECAR_TOKEN``.
  """

  def __init__(self, connect: Callable[[str, float], Connection], *,
               peers: Peers, silence_timeout: float, map_arenas: bool,
               cancel: Callable[[], None], framework: Framework | None = None,
               token: str | None = None):
    self._new_connection = connect
    self._token = token
    self._framework = framework if framework is not None else NumpyArrays()
    self.peers = peers
    self.silence_timeout = silence_timeout
    self.map_arenas = map_arenas
    self._cancel = cancel
    self.conns: dict[int, Connection] = {}
    self.workers: dict[int, worker_lib.Worker] = {}
    self.own_workers: list[worker_lib.Worker] = []
    self.device_hosts: dict[int, int] = {}  # global device id -> host id
    # N processes: global device id -> the process that owns it, and host id -> the
    # processes that drive it (several share a host's sidecar, each its own session).
    self.device_processes: dict[int, int] = {}
    self.writers: dict[int, list[int]] = {}
    self.driven: list[int] = []  # the hosts this process drives, lost or not
    self.lost: dict[int, str] = {}  # host id -> why it is lost
    self.refused: dict[int, str] = {}  # lost host -> why its returned sidecar was refused
    self.lost_listeners: list[Callable[[int, str], None]] = []
    self.back_listeners: list[Callable[[int], None]] = []
    self.rejoin = False  # reconnect to lost hosts that come back
    self.lock = threading.Lock()
    self.closed = False

  @property
  def multiprocess(self) -> bool:
    return self.peers.count > 1

  def open(self, addresses: Sequence[str], *, timeout: float,
           workers: Mapping[int, worker_lib.Worker]) -> None:
    """Connects to every sidecar, then attaches workers and learns who owns which device."""
    self.connect(list(addresses), timeout)
    if self.multiprocess:
      self.attach_own(workers)
    else:
      self.attach(workers)
      self.driven = sorted(self.conns)
      self.device_hosts = {d: h.host_id for h in self.live() for d in h.device_ids}
      if not self.device_hosts and len(self.conns) == 1 and self.workers:
        self._own_devices()

  def _own_devices(self) -> None:
    """One process attached to the one sidecar, and nothing declares devices (the
    manifests for one host, a trainer without jax.distributed): they are this process's."""
    ((host_id, conn),) = self.conns.items()
    self.device_hosts = {d: host_id for d in self._framework.local_device_ids()}
    conn.info = dataclasses.replace(conn.info, device_ids=tuple(sorted(self.device_hosts)))

  # ---- membership --------------------------------------------------------

  def live(self) -> list[HostInfo]:
    """Every live sidecar's identity, by host id."""
    return [self.conns[h].info for h in sorted(self.conns) if h not in self.lost]

  @property
  def local_hosts(self) -> list[int]:
    """The live hosts this process drives."""
    return [h for h in self.driven if h not in self.lost]

  def lost_hosts(self) -> dict[int, str]:
    with self.lock:
      return dict(self.lost)

  def select(self, hosts: Sequence[int] | int | None) -> list[int]:
    """The host ids a call named (default: those this process drives), checked."""
    if hosts is None:
      return self.local_hosts
    if isinstance(hosts, int):
      hosts = [hosts]
    chosen = list(hosts)
    lost = [h for h in chosen if h in self.lost]
    if lost:
      raise errors.HostLostError(
          f"hosts {lost} are lost ({'; '.join(self.lost[h] for h in lost)}); live hosts: "
          f"{[h.host_id for h in self.live()]}", host_id=lost[0])
    bad = [h for h in chosen if h not in self.conns]
    if bad or not chosen or len(set(chosen)) != len(chosen):
      raise errors.InvalidArgumentError(
          f"hosts={list(hosts)!r} is not a valid placement: hosts must be distinct ids among "
          f"{sorted(self.conns)}" + (f"; unknown: {bad}" if bad else ""))
    return chosen

  def health_rpcs(self) -> dict[int, tuple[Any, tuple]]:
    """``{host: (Status call, metadata)}`` of every live host, for a HealthWatch."""
    with self.lock:
      return {h: (c.status_rpc, c.metadata) for h, c in self.conns.items()
              if h not in self.lost}

  def open_stream(self, host_id: int, request: pb.CallRequest, *, prefetch: int,
                  timeout: float | None, to_device: ToDevice | None) -> Stream:
    """A stream of ``request`` from host ``host_id``: over its worker's socket where this
    process maps its arena, else over gRPC."""
    conn, w = self.conns[host_id], self.workers.get(host_id)
    if w is not None:
      return socket_transport.open_stream(w, request, prefetch=prefetch, timeout=timeout,
                                          to_device=to_device)
    def renew() -> Any:
      conn.renew()
      return conn.metadata

    return grpc_transport.open_stream(conn.stream_rpc, request, prefetch=prefetch,
                                      metadata=conn.metadata, timeout=timeout,
                                      host=conn.address, host_id=host_id, to_device=to_device,
                                      renew=renew)

  def handshakes(self) -> dict[int, dict[str, Any]]:
    """What each live sidecar told at its handshake (its address, socket, boot id and
    slice): what a checkpointer keeps."""
    return {h: {"address": c.address, "socket": c.reply.worker_socket,
                "boot_id": c.reply.identity.boot_id, "slice_id": c.info.slice_id}
            for h, c in self.conns.items() if h not in self.lost}

  def statuses(self, timeout: float) -> list[tuple[int, Connection, Any]]:
    """``(host, connection, status or grpc.RpcError)`` of every live host, asked at once."""
    calls = [(h, self.conns[h]) for h in sorted(set(self.conns) - set(self.lost))]
    futures = [c.status_rpc.future(pb.StatusRequest(), timeout=timeout, metadata=c.metadata)
               for _, c in calls]
    out = []
    for (h, c), f in zip(calls, futures):
      try:
        out.append((h, c, interrupts.wait(f)))
      except grpc.RpcError as e:
        out.append((h, c, e))
    return out

  def statuses_or_raise(self, timeout: float) -> list[pb.StatusResponse]:
    """Every live host's status, by host id; the first failure raised as ours."""
    out = []
    for h, c, s in self.statuses(timeout):
      if isinstance(s, grpc.RpcError):
        raise protocol.error_from_rpc(s, host=c.address, host_id=h) from None
      out.append(s)
    return out

  # ---- connecting --------------------------------------------------------

  def connect(self, addresses: list[str], timeout: float) -> None:
    """Handshakes every sidecar at once; all must answer, as distinct hosts of one job."""
    pool = concurrent.futures.ThreadPoolExecutor(
        max(4, len(addresses)), thread_name_prefix="sidecar-controller")
    try:
      futures = [pool.submit(self._new_connection, a, timeout) for a in addresses]
      conns, failures, refused = [], [], []
      for a, f in zip(addresses, futures):
        try:
          conns.append(f.result())
        except errors.SidecarError as e:
          failures.append(e)
          if isinstance(e, errors.AuthenticationError):
            refused.append(a)
    finally:
      pool.shutdown(wait=False)
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
    for i, c in enumerate(conns):
      if c.info.host_id in self.conns:
        other = self.conns[c.info.host_id].address
        for unkept in conns[i:]:  # those kept so far close with the rest, in close()
          unkept.close()
        raise errors.InvalidArgumentError(
            f"sidecars {other} and {c.address} both say they are host {c.info.host_id}; "
            "give each sidecar its own --host-id (or are they of two jobs, or two "
            "LocalClusters? list one job's sidecars only)")
      self.conns[c.info.host_id] = c
    fingerprints = {c.info.registry_fingerprint for c in conns}
    if len(fingerprints) > 1:
      lines = [f"host {c.info.host_id} ({c.address}): functions {list(c.info.functions)}, "
               f"pipelines {list(c.info.pipelines)}, fingerprint {c.info.registry_fingerprint}"
               for c in conns]
      raise errors.VersionMismatchError(
          "the sidecars registered different code (are they of two jobs?); deploy the same "
          "modules to every host:\n  " + "\n  ".join(lines))

  # ---- workers -----------------------------------------------------------

  def attach(self, workers: Mapping[int, worker_lib.Worker]) -> None:
    """One process: takes the given workers, then maps every other arena on this machine."""
    for host_id, w in workers.items():
      if host_id not in self.conns:
        raise errors.InvalidArgumentError(
            f"workers names host {host_id}, but the sidecars are hosts {sorted(self.conns)}")
      self.workers[host_id] = w
    if not self.map_arenas:
      return
    for host_id, c in self.conns.items():
      mine = None if host_id in self.workers else self.local_worker(c)
      if mine is not None:
        self.own_workers.append(mine)
        self.workers[host_id] = mine

  def local_worker(self, conn: Connection) -> worker_lib.Worker | None:
    """A new Worker of ``conn``'s sidecar if it runs on this machine, else None."""
    here, sock = shm.boot_id(), conn.reply.worker_socket
    if not here or conn.reply.identity.boot_id != here or not os.path.exists(sock):
      return None
    return self._worker(sock)

  def _worker(self, address: str | None) -> worker_lib.Worker:
    """A Worker of the sidecar at ``address``, presenting this controller's token."""
    return self._framework.worker(address, timeout=self.silence_timeout, token=self._token)

  def attach_own(self, workers: Mapping[int, worker_lib.Worker]) -> None:
    """N processes: attaches to this process's own sidecar; learns every process's host."""
    if len(workers) > 1:
      raise errors.InvalidArgumentError(
          f"in a job of {self.peers.count} processes each process drives one host; "
          f"workers names hosts {sorted(workers)}: pass at most one")
    if workers:
      (host_id, w), = workers.items()
    else:
      # Under a Slurm step of `sidecar slurm batch`, the job's rendezvous directory says.
      address = env_lib.get(env_lib.ADDRESS) or discovery.own_address()
      if not address:
        raise errors.InvalidArgumentError(
            f"process {self.peers.index} of {self.peers.count} does not know its own "
            f"sidecar: set {env_lib.ADDRESS}=unix:///path/to/sidecar.sock (sidecar "
            "launch and the k8s manifests do), or pass workers={host_id: Worker(...)}")
      try:
        w = self._worker(address)
      except errors.HostLostError as e:
        raise errors.DiscoveryError(
            f"process {self.peers.index}: its own sidecar at "
            f"{address} is unreachable: {e}") from None
      self.own_workers.append(w)
      host_id = w.host_id
    if host_id not in self.conns:
      raise errors.DiscoveryError(
          f"process {self.peers.index}'s own sidecar is host {host_id} ({w.path}), which is "
          f"not among the sidecars this controller reached (hosts {sorted(self.conns)}); "
          "list it in SIDECAR_HOSTS")
    self.workers[host_id] = w
    self.driven = [host_id]
    mine = {"host_id": host_id, "device_ids": self._framework.local_device_ids()}
    everyone = [json.loads(v) for v in self.peers.all_gather("controller/hosts",
                                                             json.dumps(mine))]
    self.device_hosts = hosts_by_process(everyone)
    self.device_processes = {int(d): p for p, ident in enumerate(everyone)
                             for d in ident["device_ids"]}
    self.writers = processes_by_host(everyone)
    for h, c in self.conns.items():  # what each host's trainer said, not what its sidecar
      c.info = dataclasses.replace(c.info, device_ids=tuple(  # knew at the handshake
          sorted(d for d, owner in self.device_hosts.items() if owner == h)))

  # ---- lost and back -----------------------------------------------------

  def host_lost(self, host_id: int, reason: str) -> None:
    """Marks ``host_id`` lost: work in flight stops, its worker closes, listeners hear."""
    with self.lock:
      if host_id in self.lost or self.closed:
        return
      self.lost[host_id] = reason
      worker = self.workers.pop(host_id, None)
    self._cancel()
    if worker is not None and worker in self.own_workers:
      self.own_workers.remove(worker)
      worker.close()  # unmaps the dead sidecar's arena once no array reads it
    for listener in list(self.lost_listeners):
      listener(host_id, reason)

  def host_back(self, host_id: int) -> tuple[Any, tuple] | None:
    """Reconnects to lost host ``host_id`` if ``rejoin`` is on and its sidecar answers
    again; returns its Status call and metadata for the watch, else None."""
    if not self.rejoin or self.closed:
      return None
    old = self.conns[host_id]
    try:
      conn = self._new_connection(old.address, REJOIN_TIMEOUT_S)
    except errors.SidecarError:
      return None  # still gone
    worker, refused = self._readmit(host_id, old, conn)
    if refused is not None:
      conn.close()
      if self.refused.get(host_id) != refused:
        self.refused[host_id] = refused
        log.warning("host %d answers again but stays lost: %s", host_id, refused)
      return None
    with self.lock:
      if self.closed:
        conn.close()
        if worker is not None:
          worker.close()
        return None
      self.conns[host_id] = conn
      if worker is not None:
        self.workers[host_id] = worker
        self.own_workers.append(worker)
      if not self.multiprocess and conn.info.device_ids:
        self.device_hosts.update({d: host_id for d in conn.info.device_ids})
      del self.lost[host_id]
      self.refused.pop(host_id, None)
    old.close()
    log.info("host %d is back (%s, pid %d)", host_id, conn.address, conn.info.pid)
    for listener in list(self.back_listeners):
      listener(host_id)
    return conn.status_rpc, conn.metadata

  def _readmit(self, host_id: int, old: Connection, conn: Connection
               ) -> tuple[worker_lib.Worker | None, str | None]:
    """The worker for a returned sidecar ``conn`` (if it maps), or why it stays lost."""
    if conn.info.host_id != host_id:
      return None, f"the sidecar at {old.address} is now host {conn.info.host_id}"
    if conn.info.registry_fingerprint != old.info.registry_fingerprint:
      return None, (f"its sidecar registered different code (fingerprint "
                    f"{conn.info.registry_fingerprint}, was {old.info.registry_fingerprint}); "
                    "deploy the same modules to every host")
    if not self.map_arenas or self.multiprocess:
      return None, None
    try:  # as attach did at the start
      return self.local_worker(conn), None
    except errors.SidecarError as e:
      return None, f"its arena could not be mapped: {e}"

  # ---- lifecycle ---------------------------------------------------------

  def close(self) -> None:
    """Closes the workers made here, then every connection, each sidecar told that our
    session ends (at once on all, waited for LEAVE_S at most); idempotent."""
    with self.lock:
      if self.closed:
        return
      self.closed = True
    for w in self.own_workers:
      w.close()
    leaving = []
    for c in self.conns.values():
      with contextlib.suppress(Exception):  # a channel closed already: nothing to tell
        leaving.append(c.leave())
    deadline = time.monotonic() + LEAVE_S
    for f in leaving:
      with contextlib.suppress(Exception):  # gone, or older than Leave: it expires there
        f.result(timeout=max(deadline - time.monotonic(), 0.0))
    for c in self.conns.values():
      c.close()
