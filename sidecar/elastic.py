"""Elastic training: when a host is lost, train on, on the hosts that remain.

Example::

  @sidecar.elastic.retry(ctl, min_hosts=2)
  def train(hosts):
    mesh = Mesh(np.array(sidecar.elastic.devices(ctl, hosts)), ("data",))
    ...                     # restore the latest step, reopen the feed from its position

  train()
  print(train.events)
"""

from sidecar._src.controller.elastic import Event, Regrow, Retry, phase, retry
from sidecar._src.jax.elastic import devices

__all__ = ["Event", "Regrow", "Retry", "devices", "phase", "retry"]
