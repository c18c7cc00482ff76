"""``sidecar.jax.Controller``: the controller core (``controller/controller.py``) for JAX.

The core does hosts, calls, streams, the feed's rows and the checkpoint protocol; this
class gives it the JAX adapter (``jax/framework.JaxFramework``: ``jax.Array``s,
``jax.distributed``, Orbax's names) and adds what only JAX has: ``feed(sharding=...)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax

from sidecar._src.controller import arguments, controller as core
from sidecar._src.controller.feed import Feed
from sidecar._src.controller.framework import Framework
from sidecar._src.core import options as options_lib
from sidecar._src.jax import feed as jax_feed
from sidecar._src.jax.framework import JaxFramework

log = logging.getLogger(__name__)


class Controller(core.Controller):
  """Handshakes every sidecar, then runs registered functions on them, for JAX.

  Example::

    with sidecar.jax.Controller(["10.0.0.1:8490", "10.0.0.2:8490"]) as ctl:
      print(ctl.hosts)
      results = ctl.call("normalize", args=(batch,), hosts=[0])

  Its arguments are the controller core's (``sidecar._src.controller.controller``); by
  default its ``peers`` are the processes of ``jax.distributed``, its streams' and
  feeds' arrays ``jax.Array``s, and it saves and restores pytrees of ``jax.Array``s in
  stock Orbax's layout. With one process that owns every device, this controller drives
  every host. Under ``jax.distributed`` with N processes (one per host, see
  ``sidecar.distributed``), each process's controller sees every sidecar but drives only
  its own host's data path: the sidecar at ``$SIDECAR_ADDRESS`` (or the one Worker in
  ``workers``). Every process then makes the same calls in the same order; ``call``
  runs on the caller's own host unless ``hosts`` says otherwise.
  """

  def __init__(self, addresses: Any, **kwargs: Any):
    super().__init__(addresses, **kwargs)
    if message := uncovered_hosts(self.hosts, jax.devices()):
      log.warning("%s", message)

  @staticmethod
  def _default_framework() -> Framework:
    return JaxFramework()

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
    kwargs, options = arguments.split_legacy_feed(
        name, kwargs, options, legacy_kwargs, arguments.FEED_OPTIONS)
    return self.open_feed(
        name, global_batch_size=global_batch_size,
        layout=lambda g, hosts, processes: jax_feed.Layout(sharding, g, hosts, processes),
        kwargs=kwargs, seed=seed, num_epochs=num_epochs, state=state, options=options)


def uncovered_hosts(hosts: Any, devices: list[Any]) -> str | None:
  """Why some of ``hosts`` would never be fed nor saved by this JAX process: they declare
  devices that it does not have (None when every host's devices are among ``devices``).

  A trainer started without ``JAX_NUM_CPU_DEVICES`` against ``sidecar local --hosts 2
  --devices-per-host 2`` has one CPU device: host 1's devices 2 and 3 are none of it.
  """
  have = {d.id for d in devices}
  missing = {h.host_id: sorted(set(h.device_ids) - have) for h in hosts}
  missing = {h: ids for h, ids in missing.items() if ids}
  if not missing:
    return None
  declared = sum(len(h.device_ids) for h in hosts)
  which = "; ".join(f"host {h} declares devices {ids}" for h, ids in sorted(missing.items()))
  platform = devices[0].platform if devices else "?"
  fix = (f"give this process one CPU device per sidecar device before JAX starts: "
         f"JAX_NUM_CPU_DEVICES={declared} (or XLA_FLAGS="
         f"--xla_force_host_platform_device_count={declared}); sidecar launch and "
         "LocalCluster set it" if platform == "cpu" else
         "start one trainer process per host (sidecar launch --hosts N, or the manifests), "
         "or start each sidecar with the --device-ids of the devices its trainer owns")
  return (f"{which}, which this process's {len(devices)} {platform} device(s) "
          f"{sorted(have)} do not include: those hosts' shards of a batch or a checkpoint "
          f"would go nowhere, and a feed would not use them. To use them, {fix}")
