"""Prometheus metrics of one sidecar, served on ``/metrics`` (``sidecar serve --metrics-port``).

Two kinds of figures:
- pushed from the hot paths (calls, latencies, checkpoint bytes): a :class:`Recorder`
  the runner and the checkpoint host report to. The base class records nothing, so a
  sidecar without ``--metrics-port`` pays one no-op method call per event;
- read when scraped (arena, leases, workers, feeds, RAM tier): a collector that asks the
  server's parts for a snapshot, so the feed loop and the allocator pay nothing at all.

Every sidecar has a ``CollectorRegistry`` of its own (never the global one): several
servers in one process do not clash. Label values are bounded: registered names only
(anything else is ``<unregistered>``), status code names, a few fixed kinds of work and tiers,
and the pool file's tenant names. A tenant's own things (a goodput ledger's directory, an
attached worker's or trainer's pid) are labelled by an opaque id (:func:`opaque_id`, keyed
by a secret of the tenant's): ``/metrics`` answers without a token, and a path names a
project.

A pool's six figures (issue 37), in the terms of the managed Shared Pathways Service's
(active users, chips in use, assignment time, users waiting, requested chips, successful
requests): ``sidecar_pool_tenants_active`` and ``sidecar_tenant_sessions``,
``sidecar_tenant_arena_bytes``, ``sidecar_tenant_admission_wait_seconds``,
``sidecar_pool_tenants_waiting`` and ``sidecar_tenant_waiting``,
``sidecar_tenant_requested_bytes``, ``sidecar_tenant_requests`` (by status code: the
successful ones are ``code="OK"``). docs/pool.md draws the dashboard's panel of them.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar._src.core import accounting
from sidecar._src.server import metrics_server
from sidecar._src.server.goodput import steps as steps_lib

log = logging.getLogger(__name__)

UNREGISTERED = "<unregistered>"
# The tenant label of the shared-token mode's one unnamed tenant.
SHARED_TENANT = "<shared>"
WAITS = ("inline", "arena", "session")  # what a tenant's request waits for admission to
REQUESTED = ("inline", "arena")  # what a tenant's requested bytes are of
KINDS = ("call", "stream", "feed", "checkpoint")  # checkpoint: the Checkpoint service's RPCs
EVICTIONS = ("room", "operator")  # why a durable RAM-tier copy left host memory
FLAG = "--metrics-port"
# 100 us .. 100 s: a call's round trip is ~1 ms, a step's write or replication seconds.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 25.0, 100.0)


def opaque_id(key: bytes, value: str) -> str:
  """The label ``/metrics`` shows for ``value`` (a directory, a pid) of the tenant whose
  ``key`` it is (``Tenancy.metrics_key``): 12 hex digits of its HMAC-SHA256, stable while
  the key is, telling nothing of ``value`` to whoever lacks the key."""
  return hmac.new(key, value.encode(errors="surrogateescape"), hashlib.sha256).hexdigest()[:12]


class Recorder:
  """What the hot paths report to. This base records nothing: metrics are off."""

  enabled = False

  def call_started(self, kind: str) -> None:
    """A call (``kind`` "call", "stream", "feed" or "checkpoint") began."""

  def call_done(self, kind: str, name: str, code: str, seconds: float) -> None:
    """A call ended with gRPC status ``code`` ("OK", "NOT_FOUND", ...) after ``seconds``."""

  def checkpoint_bytes(self, what: str, nbytes: int) -> None:
    """``nbytes`` more ``what`` ("staged", "written", "replicated") on this host."""

  def restored_bytes(self, tier: str, nbytes: int) -> None:
    """``nbytes`` of shards read for a restore from ``tier`` ("ram", "replica", "storage")."""

  def background(self, work: str, seconds: float) -> None:
    """What a checkpoint's background ``work`` ("write", "replicate": a step's, on this
    host) took."""

  def ram_tier_evicted(self, reason: str, nbytes: int) -> None:
    """A durable step's RAM-tier copy of ``nbytes`` left host memory for ``reason``
    (EVICTIONS: "room", new work needed its arena room; "operator", dropped on request)."""

  def tenant_request(self, tenant: str | None, kind: str, code: str) -> None:
    """A request of ``tenant`` (None: no pool) of ``kind`` (as ``call_done``'s) ended with
    gRPC status ``code``."""

  def tenant_requested(self, tenant: str | None, what: str, nbytes: int) -> None:
    """``tenant`` asked for ``nbytes`` of ``what`` (REQUESTED: an inline request's bytes
    to decode, arena bytes to allocate)."""

  def waiting(self, tenant: str | None, what: str) -> contextlib.AbstractContextManager:
    """The block in which a request of ``tenant`` waits for admission to ``what``
    (WAITS); counted as waiting while it runs, its time observed when it ends."""
    del tenant, what
    return contextlib.nullcontext()


OFF = Recorder()


@dataclasses.dataclass(frozen=True, slots=True)
class TenantFigures:
  """One tenant's use of the sidecar now, as the Status RPC's ``TenantStatus`` has it."""
  name: str
  sessions: int
  workers: int
  arena_bytes: int
  arena_guaranteed: int
  arena_ceiling: int
  feeds: int
  feed_workers: int
  saves: int = 0
  ram_tier_bytes: int = 0

  @classmethod
  def from_status(cls, s: Any) -> TenantFigures:
    """From a ``pb.TenantStatus``."""
    return cls(name=s.name, sessions=s.sessions, workers=s.workers, arena_bytes=s.arena_bytes,
               arena_guaranteed=s.arena_guaranteed, arena_ceiling=s.arena_ceiling,
               feeds=s.feeds, feed_workers=s.feed_workers, saves=s.saves,
               ram_tier_bytes=s.ram_tier_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class FeedTotals:
  """One pipeline's feeds on this host, summed (running and finished)."""
  pipeline: str
  running: int
  batches: int
  produce_s: float
  backpressure_s: float
  trainer_wait_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class GoodputFigures:
  """One goodput ledger kept on this sidecar (a tenant's, of a directory), accounted
  (``core/accounting.account``)."""
  tenant: str  # "" without tenants
  ledger: str  # its directory's opaque id (opaque_id), never the path
  wall_s: float
  productive_s: float
  goodput: float
  badput_s: tuple[tuple[str, float], ...]  # (category, seconds)
  restarts: int

  @classmethod
  def of(cls, tenant: str | None, ledger_id: str,
         ledger: accounting.Ledger) -> GoodputFigures:
    return cls(tenant=tenant or "", ledger=ledger_id, wall_s=ledger.wall_s,
               productive_s=ledger.productive_s, goodput=ledger.goodput,
               badput_s=tuple(ledger.badput_s.items()), restarts=ledger.restarts)


@dataclasses.dataclass(frozen=True, slots=True)
class TrainerFigures:
  """One attached trainer's step progress (``server/goodput/steps.py``)."""
  tenant: str  # "" without tenants
  rank: int
  trainer: str  # its pid's opaque id (opaque_id), never the pid
  since_step_s: float | None  # None: no step yet
  timeout_s: float
  stalled: bool

  @classmethod
  def of(cls, t: steps_lib.Trainer, trainer_id: str) -> TrainerFigures:
    return cls(tenant=t.tenant or "", rank=t.rank, trainer=trainer_id,
               since_step_s=t.since_step_s,
               timeout_s=t.timeout_s, stalled=t.stalled)


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
  """What the server reads for a scrape; every field is a plain number or tuple."""
  host_id: int
  slice_id: int
  uptime_s: float
  arena_size: int
  arena_used: int
  arena_blocks: int
  # (an attached worker's opaque id, bytes it holds): a session id is a capability and a
  # pid another tenant's, so neither is shown
  leased: tuple[tuple[str, int], ...]
  pinned_bytes: int  # held by the sidecar itself (views, RAM tier, unsent batches)
  workers: int
  feeds: tuple[FeedTotals, ...]
  ram_steps: int
  ram_bytes: int
  replica_steps: int
  replica_bytes: int
  writing_steps: int
  writing_bytes: int  # staged, not yet written
  tenants: tuple[TenantFigures, ...] = ()  # with a pool file: every tenant's
  goodput: tuple[GoodputFigures, ...] = ()  # the ledgers kept here: each tenant's latest
  trainers: tuple[TrainerFigures, ...] = ()  # the trainers attached


class Metrics(Recorder):
  """The metrics of one sidecar, in a registry of its own; ``serve`` starts ``/metrics``.

  The hot paths add to plain counters under one lock (about a microsecond a call);
  the collector turns them into metric families when scraped.
  """

  enabled = True

  def __init__(self, snapshot: Callable[[], Snapshot]):
    self.registry = CollectorRegistry(auto_describe=False)
    self._lock = threading.Lock()
    self._in_flight = dict.fromkeys(KINDS, 0)
    self._calls: dict[tuple[str, str, str], int] = {}  # (kind, name, code) -> calls
    # name -> [count per bucket (the last is +Inf), sum of seconds]
    self._latency: dict[str, list] = {}
    self._bytes = dict.fromkeys(("staged", "written", "replicated"), 0)
    self._restored: dict[str, int] = {}
    self._background: dict[str, list] = {}  # work -> histogram of its seconds
    self._evicted = {reason: [0, 0] for reason in EVICTIONS}  # reason -> [steps, bytes]
    self._tenant_requests: dict[tuple[str, str, str], int] = {}  # (tenant, kind, code)
    self._tenant_bytes: dict[tuple[str, str], int] = {}  # (tenant, what) -> bytes asked
    self._tenant_waiting: dict[str, int] = {}  # tenant -> requests waiting now
    self._tenant_waits: dict[str, list] = {}  # tenant -> histogram of admission waits
    self.registry.register(_Collector(snapshot, self))
    self._http: Any = None  # a metrics_server server
    self._thread: threading.Thread | None = None
    self.port = 0

  def call_started(self, kind: str) -> None:
    with self._lock:
      self._in_flight[kind] += 1

  def call_done(self, kind: str, name: str, code: str, seconds: float) -> None:
    key = (kind, name, code)
    with self._lock:
      self._in_flight[kind] -= 1
      self._calls[key] = self._calls.get(key, 0) + 1
      if kind in ("call", "checkpoint"):
        _observe(self._latency, name, seconds)

  def checkpoint_bytes(self, what: str, nbytes: int) -> None:
    with self._lock:
      self._bytes[what] += nbytes

  def restored_bytes(self, tier: str, nbytes: int) -> None:
    with self._lock:
      self._restored[tier] = self._restored.get(tier, 0) + nbytes

  def background(self, work: str, seconds: float) -> None:
    with self._lock:
      _observe(self._background, work, seconds)

  def ram_tier_evicted(self, reason: str, nbytes: int) -> None:
    with self._lock:
      self._evicted[reason][0] += 1
      self._evicted[reason][1] += nbytes

  def tenant_request(self, tenant: str | None, kind: str, code: str) -> None:
    if tenant is None:
      return
    key = (tenant or SHARED_TENANT, kind, code)
    with self._lock:
      self._tenant_requests[key] = self._tenant_requests.get(key, 0) + 1

  def tenant_requested(self, tenant: str | None, what: str, nbytes: int) -> None:
    if tenant is None:
      return
    key = (tenant or SHARED_TENANT, what)
    with self._lock:
      self._tenant_bytes[key] = self._tenant_bytes.get(key, 0) + nbytes

  @contextlib.contextmanager
  def waiting(self, tenant: str | None, what: str) -> Iterator[None]:
    if tenant is None:
      yield
      return
    name = tenant or SHARED_TENANT
    with self._lock:
      self._tenant_waiting[name] = self._tenant_waiting.get(name, 0) + 1
    t0 = time.perf_counter()
    try:
      yield
    finally:
      with self._lock:
        self._tenant_waiting[name] -= 1
        _observe(self._tenant_waits, name, time.perf_counter() - t0)

  def pushed(self) -> dict[str, Any]:
    """A copy of the pushed figures, for the collector."""
    with self._lock:
      return {"in_flight": dict(self._in_flight), "calls": dict(self._calls),
              "latency": {k: [list(v[0]), v[1]] for k, v in self._latency.items()},
              "bytes": dict(self._bytes), "restored": dict(self._restored),
              "background": {k: [list(v[0]), v[1]] for k, v in self._background.items()},
              "evicted": {k: list(v) for k, v in self._evicted.items()},
              "tenant_requests": dict(self._tenant_requests),
              "tenant_bytes": dict(self._tenant_bytes),
              "tenant_waiting": dict(self._tenant_waiting),
              "tenant_waits": {k: [list(v[0]), v[1]] for k, v in self._tenant_waits.items()}}

  def text(self) -> str:
    """The exposition text, as ``/metrics`` serves it."""
    return exposition.generate_latest(self.registry).decode()

  def serve(self, listen: str, port: int) -> int:
    """Serves ``/metrics`` on ``listen:port`` (0 picks a free port); returns the port.

    Raises:
      OSError: the port is taken or the address is not available, naming the flag.
    """
    addr = listen.strip("[]")
    try:
      self._http, self._thread = metrics_server.serve(self.registry, addr, port)
    except OSError as e:
      raise OSError(f"cannot serve metrics on {listen}:{port} ({e.strerror or e}); pick "
                    f"another {FLAG} (0 picks a free one)") from None
    self.port = int(self._http.server_port)
    return self.port

  def close(self) -> None:
    """Stops serving ``/metrics``; idempotent."""
    http, self._http = self._http, None
    if http is not None:
      http.shutdown()
      http.server_close()
    if self._thread is not None:
      self._thread.join(5)
      self._thread = None


def _observe(histograms: dict[str, list], key: str, seconds: float) -> None:
  h = histograms.get(key)
  if h is None:
    h = histograms[key] = [[0] * (len(LATENCY_BUCKETS) + 1), 0.0]
  h[0][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
  h[1] += seconds


def _histogram(name: str, doc: str, label: str, data: dict[str, list]) -> HistogramMetricFamily:
  family = HistogramMetricFamily(name, doc, labels=[label])
  for key, (counts, total) in sorted(data.items()):
    cumulative, buckets = 0, []
    for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), counts):
      cumulative += n
      buckets.append((bound, cumulative))
    family.add_metric([key], buckets, total)
  return family


class _Collector(Collector):
  """The figures read at scrape time, from one :class:`Snapshot`."""

  def __init__(self, snapshot: Callable[[], Snapshot], metrics: Metrics):
    self._snapshot = snapshot
    self._metrics = metrics

  def collect(self) -> Iterable:
    pushed, snapshot = self._metrics.pushed(), self._snapshot()
    yield from self._pushed(pushed)
    yield from self._read(snapshot)
    yield from _tenant_families(pushed, snapshot.tenants)

  @staticmethod
  def _pushed(p: dict[str, Any]) -> Iterable:
    calls = CounterMetricFamily("sidecar_calls", "Calls, streams and feeds served, by "
                                "registered name and gRPC status code",
                                labels=["kind", "name", "code"])
    for labels, n in sorted(p["calls"].items()):
      calls.add_metric(list(labels), n)
    yield calls
    yield _histogram("sidecar_call_seconds", "Time in a call on the sidecar (unary calls; "
                     "sidecar.ckpt.<rpc> are the Checkpoint service's RPCs, a save's and a "
                     "restore's calls the controller makes)", "name",
                     p["latency"])
    in_flight = GaugeMetricFamily("sidecar_calls_in_flight", "Calls, streams and feeds "
                                  "running now", labels=["kind"])
    for kind, n in p["in_flight"].items():
      in_flight.add_metric([kind], n)
    yield in_flight
    ckpt = CounterMetricFamily("sidecar_checkpoint_bytes", "Checkpoint bytes this host staged "
                               "(trainer to arena), wrote to storage, and replicated to its "
                               "replica hosts", labels=["what"])
    for what, n in p["bytes"].items():
      ckpt.add_metric([what], n)
    yield ckpt
    restored = CounterMetricFamily("sidecar_restore_bytes", "Checkpoint shard bytes read "
                                   "for restores, by tier", labels=["tier"])
    for tier, n in sorted(p["restored"].items()):
      restored.add_metric([tier], n)
    yield restored
    yield _histogram("sidecar_checkpoint_background_seconds", "A checkpoint's background "
                     "work on this host (a step's write, its replication), per step", "work",
                     p["background"])
    # Its old name and label, the same figures, until 0.4.0: a dashboard keeps working.
    yield _histogram("sidecar_checkpoint_phase_seconds", "Deprecated, removed in 0.4.0: "
                     "sidecar_checkpoint_background_seconds{work}", "phase", p["background"])
    evictions = CounterMetricFamily("sidecar_ram_tier_evictions", "Durable steps whose "
                                    "RAM-tier copy left host memory before its budget said: "
                                    "room (new work needed the arena), operator (dropped)",
                                    labels=["reason"])
    evicted = CounterMetricFamily("sidecar_ram_tier_evicted_bytes", "Bytes of those copies",
                                  labels=["reason"])
    for reason, (steps, nbytes) in p["evicted"].items():
      evictions.add_metric([reason], steps)
      evicted.add_metric([reason], nbytes)
    yield evictions
    yield evicted

  @staticmethod
  def _read(s: Snapshot) -> Iterable:

    def gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
      g = GaugeMetricFamily(name, doc, labels=list(labels))
      g.add_metric(list(labels.values()), value)
      return g

    yield gauge("sidecar_host_info", "This sidecar's host and slice (always 1)", 1,
                host_id=str(s.host_id), slice_id=str(s.slice_id))
    yield gauge("sidecar_uptime_seconds", "Seconds since this sidecar started", s.uptime_s)
    yield gauge("sidecar_arena_size_bytes", "Size of the shared-memory arena", s.arena_size)
    yield gauge("sidecar_arena_used_bytes", "Arena bytes allocated", s.arena_used)
    yield gauge("sidecar_arena_blocks", "Arena blocks allocated", s.arena_blocks)
    leased = GaugeMetricFamily("sidecar_arena_leased_bytes", "Arena bytes held by each "
                               "attached worker (by an opaque id of its pid, keyed by its "
                               "tenant's token)", labels=["worker"])
    for worker, nbytes in s.leased:
      leased.add_metric([worker], nbytes)
    yield leased
    yield gauge("sidecar_arena_pinned_bytes", "Arena bytes held by the sidecar itself "
                "(its views, the RAM tier, batches not yet sent)", s.pinned_bytes)
    yield gauge("sidecar_workers_connected", "Worker sessions attached", s.workers)
    running = GaugeMetricFamily("sidecar_feeds_running", "Feeds running, by pipeline",
                                labels=["pipeline"])
    families = {name: CounterMetricFamily(f"sidecar_feed_{name}", doc, labels=["pipeline"])
                for name, doc in (
                    ("batches", "Batches produced"),
                    ("produce_seconds", "Seconds spent producing batches"),
                    ("backpressure_seconds", "Seconds the producer waited for credits "
                     "(the trainer is slower)"),
                    ("trainer_wait_seconds", "Seconds the trainer reported waiting for "
                     "batches (the feed is slower)"))}
    for f in s.feeds:
      running.add_metric([f.pipeline], f.running)
      for name, value in (("batches", f.batches), ("produce_seconds", f.produce_s),
                          ("backpressure_seconds", f.backpressure_s),
                          ("trainer_wait_seconds", f.trainer_wait_s)):
        families[name].add_metric([f.pipeline], value)
    yield running
    yield from families.values()
    tier_steps = GaugeMetricFamily("sidecar_ram_tier_steps", "Committed steps held in host memory",
                              labels=["kind"])
    tier_bytes = GaugeMetricFamily("sidecar_ram_tier_bytes", "Bytes of committed steps held in "
                               "host memory", labels=["kind"])
    for kind, n, b in (("own", s.ram_steps, s.ram_bytes),
                       ("replica", s.replica_steps, s.replica_bytes)):
      tier_steps.add_metric([kind], n)
      tier_bytes.add_metric([kind], b)
    yield tier_steps
    yield tier_bytes
    yield gauge("sidecar_checkpoint_writing_steps", "Steps being written to storage",
                s.writing_steps)
    yield gauge("sidecar_checkpoint_writing_bytes", "Staged bytes not yet written to "
                "storage", s.writing_bytes)
    if s.goodput:
      yield from _goodput_families(s.goodput)
    if s.trainers:
      yield from _trainer_families(s.trainers)


_LEDGER = ["tenant", "ledger"]


def _goodput_families(ledgers: tuple[GoodputFigures, ...]) -> Iterable:
  """The goodput ledgers kept here (docs/goodput.md), each labelled with its tenant and
  its directory's opaque id: their shares, and their time split."""
  for name, doc, value in (
      ("sidecar_goodput_ratio", "The job's goodput: productive seconds over wall seconds",
       lambda g: g.goodput),
      ("sidecar_goodput_wall_seconds", "The job's wall-clock seconds in its ledger",
       lambda g: g.wall_s),
      ("sidecar_goodput_productive_seconds", "Seconds of the job's steps that counted",
       lambda g: g.productive_s),
      ("sidecar_goodput_restarts", "Trainer deaths followed by a new trainer process",
       lambda g: g.restarts)):
    family = GaugeMetricFamily(name, doc, labels=_LEDGER)
    for g in ledgers:
      family.add_metric([g.tenant, g.ledger], value(g))
    yield family
  badput = GaugeMetricFamily("sidecar_goodput_badput_seconds", "Seconds of the job's wall "
                             "time lost, by category", labels=[*_LEDGER, "category"])
  for g in ledgers:
    for category, seconds in g.badput_s:
      badput.add_metric([g.tenant, g.ledger, category], seconds)
  yield badput


def _trainer_families(trainers: tuple[TrainerFigures, ...]) -> Iterable:
  """Each attached trainer's seconds since its last step, and whether it is stalled
  (``core/stall.py``): the stall signal, by tenant, rank and trainer (its pid's opaque
  id)."""
  labels = ["tenant", "rank", "trainer"]
  since = GaugeMetricFamily("sidecar_trainer_seconds_since_step", "Seconds since the "
                            "trainer's last step (feed batches taken, a save)", labels=labels)
  limit = GaugeMetricFamily("sidecar_trainer_stall_timeout_seconds", "No step for longer "
                            "than this: the trainer is stalled (0: never)", labels=labels)
  stalled = GaugeMetricFamily("sidecar_trainer_stalled", "1 where the trainer is stalled",
                              labels=labels)
  for t in trainers:
    key = [t.tenant, str(t.rank), t.trainer]
    if t.since_step_s is not None:
      since.add_metric(key, t.since_step_s)
    limit.add_metric(key, t.timeout_s)
    stalled.add_metric(key, float(t.stalled))
  yield from (since, limit, stalled)



def _tenant_families(p: dict[str, Any], tenants: tuple[TenantFigures, ...]) -> Iterable:
  """The pool's figures, by tenant: the six of the managed service's, and their parts."""
  names = sorted({t.name for t in tenants} | set(p["tenant_waiting"])
                 | {k[0] for k in p["tenant_requests"]} | {k[0] for k in p["tenant_bytes"]})
  active = [t for t in tenants if t.sessions or t.workers]
  waiting = {n: p["tenant_waiting"].get(n, 0) for n in names}
  yield GaugeMetricFamily("sidecar_pool_tenants_active", "Tenants with a session or a "
                          "worker attached (the managed service's active users)",
                          value=len(active))
  yield GaugeMetricFamily("sidecar_pool_tenants_waiting", "Tenants with a request waiting "
                          "for admission (the managed service's users waiting)",
                          value=sum(1 for n in waiting.values() if n > 0))
  per_tenant = {
      "sessions": ("Handshake sessions", lambda t: t.sessions),
      "workers": ("Workers attached", lambda t: t.workers),
      "arena_bytes": ("Arena bytes it holds (the managed service's chips in use)",
                      lambda t: t.arena_bytes),
      "arena_guaranteed_bytes": ("Its guaranteed arena share (the pool file's arena)",
                                 lambda t: t.arena_guaranteed),
      "arena_ceiling_bytes": ("The most arena it may hold", lambda t: t.arena_ceiling),
      "feeds": ("Feeds running", lambda t: t.feeds),
      "feed_workers": ("Feed worker processes of its feeds", lambda t: t.feed_workers),
      "saves": ("Saves of its steps in progress (staged, being written or waiting for "
                "their commit)", lambda t: t.saves),
      "ram_tier_bytes": ("Bytes of the RAM-tier copies of its committed steps",
                         lambda t: t.ram_tier_bytes)}
  for metric, (doc, get) in per_tenant.items():
    family = GaugeMetricFamily(f"sidecar_tenant_{metric}", doc, labels=["tenant"])
    for t in tenants:
      family.add_metric([t.name or SHARED_TENANT], get(t))
    yield family
  now = GaugeMetricFamily("sidecar_tenant_waiting", "Its requests waiting for admission now",
                          labels=["tenant"])
  for name, n in waiting.items():
    now.add_metric([name], n)
  yield now
  yield _histogram("sidecar_tenant_admission_wait_seconds", "Time its requests waited for "
                   "admission: inline bytes, arena room, a session (the managed service's "
                   "assignment time)", "tenant", p["tenant_waits"])
  requested = CounterMetricFamily("sidecar_tenant_requested_bytes", "Bytes it asked for: inline "
                               "requests to decode, arena blocks (the managed service's "
                               "requested chips)", labels=["tenant", "what"])
  for (name, what), n in sorted(p["tenant_bytes"].items()):
    requested.add_metric([name, what], n)
  yield requested
  requests = CounterMetricFamily("sidecar_tenant_requests", "Its calls, streams and feeds, by "
                               "gRPC status code (code=\"OK\": the managed service's "
                               "successful requests)", labels=["tenant", "kind", "code"])
  for labels, n in sorted(p["tenant_requests"].items()):
    requests.add_metric(list(labels), n)
  yield requests
