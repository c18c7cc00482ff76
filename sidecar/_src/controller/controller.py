"""The controller: one client with the global view of every sidecar, with no framework.

This is the core that every framework's controller builds on: hosts, calls, streams,
feeds over a :class:`~sidecar._src.controller.feed.BatchLayout` and the checkpoint
protocol, with a :class:`~sidecar._src.controller.framework.Framework` adapter for what
names a framework's types (``controller/framework.py`` draws the picture). With the
default adapter (``NumpyArrays``) it calls, streams and checkpoints numpy arrays and loads
no framework; ``sidecar.jax.Controller`` is the JAX one (``jax/controller.py``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from sidecar._src.arena import worker as worker_lib
from sidecar._src.controller import (
  arguments,
  discovery,
  display,
  feed as feed_lib,
  goodput as goodput_lib,
  health,
  startup,
)
from sidecar._src.controller.calls import Calls
from sidecar._src.controller.checkpoint import ram_drop
from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.checkpoint.client import CheckpointClient
from sidecar._src.controller.checkpoint.options import CheckpointOptions, options_or
from sidecar._src.controller.checkpoint.plugs import key_value_driver
from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot, Snapshots
from sidecar._src.controller.children import Children
from sidecar._src.controller.connection import Connection, HostInfo
from sidecar._src.controller.feed import Feed, LayoutFactory
from sidecar._src.controller.framework import Framework, NumpyArrays
from sidecar._src.controller.peers import Peers
from sidecar._src.controller.sidecars import Sidecars
from sidecar._src.core import (
  address as address_lib,
  env as env_lib,
  errors,
  interrupts,
  options as options_lib,
  stall,
)
from sidecar._src.streams.consumer import Stream
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb


class State(enum.Enum):
  OPEN = "open"
  CLOSED = "closed"


class Controller:
  """Handshakes every sidecar, then runs registered functions on them.

  Example::

    with sidecar.jax.Controller(["10.0.0.1:8490", "10.0.0.2:8490"]) as ctl:
      print(ctl.hosts)
      results = ctl.call("normalize", args=(batch,), hosts=[0])

  Args:
    addresses: the sidecars' gRPC addresses: ``unix:PATH`` for one on this machine's Unix
      socket (``sidecar serve --listen unix:PATH``), else ``host:port``. One that can never
      answer (a path without ``unix:``, a port outside 1..65535, a host name that does not
      resolve) is InvalidArgumentError at once, naming it and the forms.
    token: the sidecars' bearer token; default ``$SIDECAR_TOKEN`` or ``$SIDECAR_TOKEN_FILE``.
    timeout: default deadline in seconds of every call.
    connect_timeout: how long to wait for each sidecar to answer the handshake.
    workers: ``{host_id: Worker}`` for hosts whose arena this process maps. By default
      (``attach=True``) the controller attaches to every sidecar on this machine itself,
      so large arrays move through shared memory instead of the network.
    peers: the trainer processes of this job (default: the framework's, e.g. those of
      ``jax.distributed``).
    silence_timeout: seconds a sidecar may stay silent (hung, SIGSTOPped) before what waits
      on it (a feed, a stream, a request of its worker) ends with HostLostError; default
      ``$SIDECAR_PEER_TIMEOUT`` or 30. A slow pipeline is no silence: its sidecar still
      answers the pings.
    tls_ca, tls_cert, tls_key: PEM files for TLS to the sidecars' control ports (``sidecar
      serve --tls-cert``): the CA that signed their certificates (default
      ``$SIDECAR_TLS_CA``, else the system's roots), and for mTLS (``--tls-client-ca``)
      this controller's certificate and key (``$SIDECAR_TLS_CLIENT_CERT``,
      ``$SIDECAR_TLS_CLIENT_KEY``). None given or set: plaintext.
    framework: the adapter of the trainer's framework (``controller/framework.py``);
      default: this class's (numpy arrays only here, JAX in ``sidecar.jax.Controller``).

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
               peers: Peers | None = None, silence_timeout: float | None = None,
               tls_ca: str | None = None, tls_cert: str | None = None,
               tls_key: str | None = None, framework: Framework | None = None):
    if isinstance(addresses, str) or not addresses or not all(
        isinstance(a, str) for a in addresses):
      raise errors.InvalidArgumentError(
          f"addresses must be a non-empty list of 'unix:PATH' or 'host:port' strings, got "
          f"{addresses!r}")
    # One that could never answer (a path without unix:, a port out of range, a host name
    # that does not exist) is refused now, naming the form to use, not dialed.
    address_lib.check_resolvable([address_lib.parse(a, what="sidecar address")
                                  for a in addresses], what="sidecar addresses")
    if timeout <= 0:
      raise errors.InvalidArgumentError(f"timeout must be positive seconds, got {timeout!r}")
    self.timeout = timeout
    self.silence_timeout = env_lib.silence_timeout(silence_timeout)
    self.state = State.OPEN
    token = token if token is not None else env_lib.token()  # $SIDECAR_TOKEN(_FILE)
    credentials = protocol.tls_credentials(tls_ca, tls_cert, tls_key)
    self._framework = framework if framework is not None else self._default_framework()
    self._peers = peers if peers is not None else self._framework.peers()
    self._sidecars = Sidecars(  # a lost host's sidecar that comes back: the same token
        lambda address, timeout: Connection(address, token=token, timeout=timeout,
                                            silence_timeout=self.silence_timeout,
                                            credentials=credentials),
        peers=self._peers, silence_timeout=self.silence_timeout, map_arenas=attach,
        cancel=self.cancel, framework=self._framework, token=token)
    self._calls = Calls(connection=self._sidecars.conns.__getitem__,
                        worker=self._sidecars.workers.get)
    self._snapshots = Snapshots(self._sidecars, status=self.status)  # for checkpointers
    self._feeds = self._checkpointers = 0  # made so far: SPMD names for their exchanges
    self._children = Children()  # the feeds, streams and checkpointers it made
    self._watch: health.HealthWatch | None = None
    self._lock = threading.Lock()
    self._goodput: goodput_lib.LedgerClient | None = None
    try:
      self._sidecars.open(addresses, timeout=connect_timeout, workers=workers or {})
    except BaseException:
      self.close()
      raise
    self._goodput = goodput_lib.LedgerClient.of_process(
        self._peers.index, (self._sidecars.workers.get(h) for h in self.local_hosts))
    # Its first completed step, told to its sidecars' stall rule (controller/startup.py).
    self._startup = startup.Startup(self._mapped_workers, then=(
        None if self._goodput is None else self._goodput.batch))

  def _mapped_workers(self) -> list[worker_lib.Worker]:
    return [w for h, w in self._sidecars.workers.items() if h not in self._sidecars.lost]

  def phase(self, name: str, /, *, budget_s: float, until_step: bool = False
            ) -> contextlib.AbstractContextManager[None]:
    """A long phase without steps (an evaluation, a large restore): while it lasts, the
    stall rule of the sidecars this process maps waits up to ``budget_s`` seconds for a
    step before it counts this trainer as stalled (``sidecar launch --stall-timeout``;
    docs/elastic.md). Its start and end count as steps; its length never counts as the
    slowest step. With ``until_step``, it ends at the next completed step (the second
    batch this process's thread takes from a feed after it began, or the second save that
    returns after it began: a trainer with no feed of ours), or at the block's end if that
    comes first: a block that restores, re-meshes and then trains, whose first
    step recompiles (``sidecar.elastic.retry`` runs each attempt so).

    Example::

      with ctl.phase("eval", budget_s=900):
        metrics = evaluate(state)

    Raises:
      InvalidArgumentError: ``name`` not 1..64 printable characters, or ``budget_s`` not
        seconds in (0, 86400].
    """
    return self._startup.phase(name, budget_s, until_step=until_step)

  @staticmethod
  def _default_framework() -> Framework:
    """The adapter of a Controller made with no ``framework``; subclasses name theirs."""
    return NumpyArrays()

  @classmethod
  def from_env(cls, *, timeout: float = 300.0, **kwargs: Any) -> Self:
    """Finds every sidecar of this job from the environment, then connects.

    On Kubernetes the manifests in ``k8s/`` set what this reads (JobSet name, slices, hosts
    per slice, ports); elsewhere ``SIDECAR_HOSTS=host[:port],...`` lists them. Waits up to
    ``timeout`` seconds for every sidecar to answer its health check, then raises
    DiscoveryError listing those that did not; a ``SIDECAR_HOSTS`` entry that can never
    answer (a path without ``unix:``, a port out of range, a host name that does not
    resolve) is InvalidArgumentError at once. Under Slurm (``sidecar slurm batch``) it
    reads the job's rendezvous directory; with ``SIDECAR_CLUSTER_FILE`` it joins a service
    as :meth:`from_cluster_file` does.
    """
    found = discovery.find(timeout=timeout)
    return cls(list(found.addresses), **found.controller_kwargs(kwargs, env_token_first=True))

  @classmethod
  def from_cluster_file(cls, path: str, *, timeout: float = 60.0, **kwargs: Any
                        ) -> Self:
    """Joins the sidecars of a service (``sidecar slurm service``) through its cluster file.

    Example::

      ctl = sidecar.jax.Controller.from_cluster_file("~/.sidecar/my-service/cluster.env")

    Raises:
      InvalidArgumentError: the file is missing or malformed, or its token file is
        unreadable or readable by others (the message names it).
      DiscoveryError: the service's Slurm job has ended (the message names the job), or
        its sidecars do not all answer within ``timeout`` seconds.
    """
    found = discovery.from_cluster_file(os.path.expanduser(str(path)), timeout=timeout)
    return cls(list(found.addresses), **found.controller_kwargs(kwargs, env_token_first=False))

  @property
  def multiprocess(self) -> bool:
    """Whether this is one of several trainer processes, each driving its own host."""
    return self._peers.count > 1

  @property
  def framework(self) -> Framework:
    """The adapter of the trainer's framework that this controller uses."""
    return self._framework

  @property
  def peers(self) -> Peers:
    """This job's trainer processes, for exchanges of your own (``all_gather``,
    ``broadcast``, ``check_same``); with one process, trivially itself."""
    return self._peers

  @property
  def process_index(self) -> int:
    """This trainer process's index in the job (0 with one process)."""
    return self._peers.index

  @property
  def local_hosts(self) -> list[int]:
    """The live hosts this process drives: all of them, or its own under N processes."""
    return self._sidecars.local_hosts

  @property
  def device_hosts(self) -> dict[int, int]:
    """``{global device id: host id}`` for every device of the job."""
    return dict(self._sidecars.device_hosts)

  @property
  def hosts(self) -> list[HostInfo]:
    """Every live sidecar's identity, by host id (lost hosts are dropped)."""
    return self._sidecars.live()

  @property
  def lost_hosts(self) -> dict[int, str]:
    """``{host id: why}`` of the hosts found lost (see :meth:`watch`)."""
    return self._sidecars.lost_hosts()

  def watch(self, *, interval: float = health.DEFAULT_INTERVAL_S,
            lost_after: float = health.DEFAULT_LOST_AFTER_S, rejoin: bool = False) -> None:
    """Polls every live host's health; one silent for ``lost_after`` s is lost.

    A lost host leaves :attr:`hosts`; the feeds and streams this controller made are closed
    (their ``next()`` raises instead of waiting on a host that will not answer), its arena
    is unmapped here once no array reads it, and the listeners added with
    :meth:`on_host_lost` are told. With ``rejoin=True`` a lost host is asked every second
    whether its sidecar is back (a new one at the same address, with the same registered
    code): then it is reconnected, rejoins :attr:`hosts` with an empty arena, and the
    listeners added with :meth:`on_host_back` are told. Idempotent.
    """
    self._check_open()
    with self._lock:
      self._sidecars.rejoin = self._sidecars.rejoin or rejoin
      if self._watch is not None:
        return
      self._watch = health.HealthWatch(
          self._sidecars.health_rpcs(), on_lost=self._sidecars.host_lost, interval=interval,
          lost_after=lost_after, rejoin=self._sidecars.host_back)
      self._watch.start()

  def on_host_lost(self, listener: Callable[[int, str], None]) -> None:
    """Calls ``listener(host_id, reason)`` (on the watch's thread) when a host is lost."""
    self._sidecars.lost_listeners.append(listener)

  def on_host_back(self, listener: Callable[[int], None]) -> None:
    """Calls ``listener(host_id)`` (on the watch's thread) when a lost host rejoins."""
    self._sidecars.back_listeners.append(listener)

  def cancel(self) -> None:
    """Closes every feed and stream this controller made: work in flight stops."""
    self._children.cancel()

  def worker(self, host_id: int) -> worker_lib.Worker | None:
    """The worker that maps host ``host_id``'s arena here, if any."""
    return self._sidecars.workers.get(host_id)

  def _first_host(self) -> int:
    """The host a stream goes to by default: this process's first."""
    return (self.local_hosts or self._sidecars.driven)[0]

  def _check_open(self) -> None:
    if self.state is State.CLOSED:
      raise errors.ClosedError("this Controller is closed; make a new one")

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
    chosen = self._sidecars.select(hosts)
    timeout = self.timeout if timeout is None else timeout
    if len(chosen) == 1:  # No thread hop: the common single-host call stays on this thread.
      return [self._calls.call_sync(chosen[0], name, args, kwargs, timeout)]
    futures = [self._calls.call_future(h, name, args, kwargs, timeout) for h in chosen]
    return [interrupts.wait(f) for f in futures]

  def stream(self, name: str, /, *legacy_args: Any, args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None, host: int | None = None,
             prefetch: int = 2, timeout: float | None = None, device: Any = None,
             **legacy_kwargs: Any) -> Stream:
    """Iterates what registered function ``name(*args, **kwargs)`` returns (an iterable).

    ``host`` defaults to the first host this process drives (its own under N processes).

    The sidecar runs at most ``prefetch`` items ahead of this consumer. When this process
    maps that host's arena, items come over its Unix socket (the fast path); otherwise
    over gRPC, with arrays inline. With ``device``, arrays arrive on it as the framework's
    (``jax.Array``s, from the arena with no copy on the CPU backend). ``timeout`` bounds
    the wait for each item: past it ``next()`` raises DeadlineExceededError and the
    stream stays open.
    ``*legacy_args``/``**legacy_kwargs``: the deprecated shorthand for ``args``/``kwargs``.

    Example::

      with ctl.stream("batches", kwargs={"split": "train"}, host=0, prefetch=4) as s:
        for batch in s:
          ...
    """
    self._check_open()
    args, kwargs = arguments.split_legacy("stream", name, args, kwargs, legacy_args,
                                          legacy_kwargs, stacklevel=3)
    (host_id,) = self._sidecars.select([self._first_host() if host is None else host])
    held: list = []
    request = self._calls.request(host_id, name, args, kwargs, self.timeout, held)
    return self._open_stream(host_id, request, prefetch=prefetch, timeout=timeout, held=held,
                             device=device)

  def _open_stream(self, host_id: int, request: pb.CallRequest, *, prefetch: int,
                   timeout: float | None, held: list, device: Any = None) -> Stream:
    to_device = None if device is None else functools.partial(self._framework.to_device,
                                                              device=device)
    stream = self._sidecars.open_stream(host_id, request, prefetch=prefetch, timeout=timeout,
                                     to_device=to_device)
    stream.args = held  # Argument blocks live as long as the stream.
    self._children.add(stream)
    return stream

  def open_feed(self, name: str, /, *, global_batch_size: int, layout: LayoutFactory,
                kwargs: Mapping[str, Any] | None = None, seed: int = 0,
                num_epochs: int | None = None, state: dict[str, Any] | None = None,
                options: options_lib.FeedOptions | None = None) -> Feed:
    """Global batches of registered pipeline ``name``, each host's rows laid out by a
    framework's :class:`~sidecar._src.controller.feed.BatchLayout`.

    What a framework's feed is made of (``sidecar.jax.Controller.feed`` for JAX): each host's
    sidecar runs the pipeline and produces the rows ``layout`` gives it; they arrive
    through its arena and the layout makes each leaf of a batch of them. The batches
    depend only on ``name``, ``kwargs``, ``seed`` and the batch index.

    Args:
      name: a registered ``@sidecar.pipeline``.
      global_batch_size: rows of every global batch.
      layout: ``layout(global_batch_size, device_hosts, device_processes)`` -> the
        BatchLayout, made once the arguments are checked (``{device id: host id}``, and
        ``{device id: process index}`` where several processes share hosts, else empty).
      kwargs, seed, num_epochs, state, options: as ``sidecar.jax.Controller.feed``'s.
    """
    self._check_open()
    options = feed_lib.check_arguments(name, options, self.hosts,
                                       global_batch_size=global_batch_size,
                                       num_epochs=num_epochs)
    rows = layout(global_batch_size, dict(self._sidecars.device_hosts),
                  dict(self._sidecars.device_processes))
    self._feeds += 1
    feed = feed_lib.check_and_open(
        name, self._feeds, global_batch_size=global_batch_size, layout=rows,
        kwargs=kwargs or {}, seed=seed, num_epochs=num_epochs, state=state, options=options,
        peers=self._peers, local_hosts=self.local_hosts,
        open_call=lambda host_id, request: self._open_stream(
            host_id, request, prefetch=options.prefetch, timeout=None, held=[]),
        session=lambda host_id: getattr(self._sidecars.workers.get(host_id), "session", ""),
        arena_use=lambda: {s.identity.host_id: s.arena_used / max(s.arena_size, 1)
                           for s in self.status()},
        on_batch=self._startup.batch)
    self._children.add(feed)
    return feed

  def feed_length(self, name: str, /, *, global_batch_size: int,
                  kwargs: Mapping[str, Any] | None = None, seed: int = 0,
                  num_epochs: int | None = None) -> int | None:
    """Global batches a feed of ``name`` with these arguments yields from its start, as
    this process's first sidecar answers without reading a row (a ``grain.MapDataset``'s
    for ``num_epochs``); None where the pipeline returns an iterable or reads forever."""
    self._check_open()
    return feed_lib.length(name, global_batch_size=global_batch_size, kwargs=kwargs or {},
                           seed=seed, num_epochs=num_epochs,
                           open_call=lambda request: self._open_stream(
                               self._first_host(), request, prefetch=1, timeout=None, held=[]))

  def checkpointer(self, directory: str, *, max_to_keep: int | None = None,
                   keep_period: int | None = None, ram_steps: int = 1,
                   ram_budget: int | None = None, if_busy: str = "wait",
                   sweep: bool = True, replicas: int = 0,
                   replica_bandwidth: int | str | None = None,
                   options: CheckpointOptions | None = None) -> Checkpointer:
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

    With ``replicas=R`` (at most hosts - 1; fewer live hosts get fewer, with a warning),
    each sidecar sends a staged step's shards to R other sidecars (another slice's first,
    else the next hosts) in the background: ``handle.replicated`` resolves once every
    shard has its copies. Replicas count toward ``ram_budget`` and leave with their step;
    a restore takes each shard from any live copy, storage last, so losing a host loses
    no step the RAM tiers hold (``ckpt.last_restore_stats()`` says where shards came
    from). ``replica_bandwidth`` (bytes/s per sidecar, or a size such as ``"500MiB"``)
    paces the sending, leaving the training step its cores, memory bandwidth or network.

    ``options`` (a :class:`~sidecar._src.controller.checkpoint.options.CheckpointOptions`,
    the same as ``sidecar.torch.Checkpointer``'s) instead of those keyword arguments.

    Raises:
      InvalidArgumentError: ``directory`` is not writable from every sidecar, or both
        ``options`` and the keyword arguments it holds are given.
    """
    self._check_open()
    o = options_or(options, max_to_keep=max_to_keep, keep_period=keep_period,
                   ram_steps=ram_steps, ram_budget=ram_budget, if_busy=if_busy,
                   replicas=replicas, replica_bandwidth=replica_bandwidth)
    self._checkpointers += 1
    site = self.checkpoint_sidecars()
    ckpt = Checkpointer(
        str(directory), site=site, options=o, peers=self._peers,
        driver=key_value_driver(options=o, peers=self._peers, framework=self._framework),
        key=f"ckpt/{self._checkpointers}", sweep=sweep)
    self._children.add(ckpt)
    return ckpt

  def _saved(self, data_state: Any) -> None:
    """A checkpointer of this controller saved (not skipped), with ``data_state``."""
    self._startup.saved()
    self._children.saved(data_state)

  def checkpoint_client(self) -> CheckpointClient:
    """The checkpoint phases on these sidecars, through this controller's channels: what
    a framework's checkpoint adapter (``sidecar.torch.StorageWriter``) drives."""
    return self._snapshots.client(self.timeout)

  def checkpoint_sidecars(self) -> SidecarsSnapshot:
    """These sidecars as a checkpointer sees them now (a new checkpoint client, the hosts,
    which of them this process drives and maps, where their replicas go). In a single
    controller it also says how to see them again, so that a checkpointer follows the
    live hosts (``SidecarsSnapshot.live``)."""
    self._check_open()
    return self._snapshot(self.checkpoint_client())

  def _snapshot(self, client: CheckpointClient) -> SidecarsSnapshot:
    """The sidecars now, through ``client``."""
    self._check_open()
    one = not self.multiprocess  # N processes: each one's view of a loss may differ
    return self._snapshots.snapshot(
        client, goodput=self._goodput, saved=self._saved,
        now=functools.partial(self._snapshot, client) if one else None)

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
    return [self._calls.call_future(h, name, args, kwargs, timeout)
            for h in self._sidecars.select(hosts)]

  @interrupts.deferring
  def status(self, *, timeout: float | None = None) -> list[pb.StatusResponse]:
    """Each sidecar's status (identity, registry, arena use, uptime), by host id.

    Asks every host at once; ``timeout`` (default: the controller's) bounds each.
    """
    self._check_open()
    return self._sidecars.statuses_or_raise(self.timeout if timeout is None else timeout)

  def drop_ram_tier(self, directory: str | None = None, *, tenant: str | None = None,
                    timeout: float | None = None) -> ram_drop.RamTierDrop:
    """Drops RAM-tier copies of durable steps on every sidecar this controller reaches:
    those of ``directory`` (and the directories in it), or every directory ``tenant``
    opened (a pool's tenant; the pool's operator token may name any). They would give
    way by themselves to new work that needs the arena; this frees them now. Steps not
    durable yet stay, listed in ``kept``.

    Example::

      print(ctl.drop_ram_tier("/ckpt/run1").describe())

    Raises:
      InvalidArgumentError: neither or both of ``directory`` and ``tenant``.
      PermissionDeniedError: a tenant's token named another tenant's copies.
    """
    self._check_open()
    req = ram_drop.request(None if directory is None else os.path.abspath(directory), tenant)
    conns = [(h, c) for h, c in self._sidecars.conns.items() if h not in self._sidecars.lost]
    return ram_drop.drop(conns, req, timeout=self.timeout if timeout is None else timeout)

  @interrupts.deferring
  def _display(self, *, as_html: bool) -> str:
    rows = [] if self.state is State.CLOSED else display.status_rows(
        self._sidecars.statuses(display.STATUS_TIMEOUT_S))
    facts = display.controller_facts(
        state=self.state.value, live=len(self.hosts), lost=self.lost_hosts,
        process=self.process_index, processes=self._peers.count, local_hosts=self.local_hosts,
        feeds=self._children.open_feeds(), checkpointers=self._children.open_checkpointers())
    return display.hosts_block("sidecar.jax.Controller", facts, rows, as_html=as_html)

  def __repr__(self) -> str:
    return self._display(as_html=False)

  def _repr_html_(self) -> str:
    return self._display(as_html=True)

  def close(self) -> None:
    """Closes what this controller made (feeds and streams, then checkpointers, which
    finish the save in flight), its workers and channels; idempotent. A checkpointer's
    save that failed and was not raised yet (by its own save(), wait() or close()) is
    logged."""
    if self.state is State.CLOSED:
      return
    # Its steps are over: what follows (the saves waited for, its exit) is no stall.
    startup.tell(self._mapped_workers(), stall.Phase(stall.CLOSE, stall.MAX_BUDGET_S))
    if self._watch is not None:
      self._watch.stop()
    self.cancel()
    self._children.close(lambda: self.lost_hosts)  # each checkpointer ends its save first
    if self._goodput is not None:  # a clean end: the sidecar records no death
      self._goodput.finish()
    self.state = State.CLOSED
    self._sidecars.close()  # the workers it made, then the channels
    self._calls.close()  # its caller threads: their calls ended with the channels

  def __enter__(self) -> Self:
    return self

  def __exit__(self, exc_type: Any, *exc: Any) -> None:
    if exc_type is not None and self._goodput is not None:
      self._goodput.abandon()  # it failed: its ledger records a death, not a finish
    self.close()
