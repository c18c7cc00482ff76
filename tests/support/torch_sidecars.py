"""What the PyTorch checkpoint path asks of a Controller, in process: :class:`FakeController`
over ``tests/support/fake_sidecars.FakeSidecars`` (one rank, no sockets), and
:class:`Recording`, a fake that records each phase with the format's extra it was given."""

import concurrent.futures
import threading

from sidecar._src.controller.checkpoint.sidecars import SidecarsSnapshot
from sidecar._src.controller.peers import LocalPeers
from tests.support.fake_sidecars import FakeSidecars


class FakeController:
  """One rank's Controller as the checkpoint path reads it: the sidecars ``fake`` (this
  rank drives the first), its peers (one process), the Worker mapping its arena (``worker``:
  anything with ``ref_of``; None: not mapped)."""

  def __init__(self, fake: FakeSidecars, *, worker=None):
    self.fake, self.peers, self._worker = fake, LocalPeers(), worker

  def checkpoint_sidecars(self) -> SidecarsSnapshot:
    hosts = tuple(self.fake.hosts)
    return SidecarsSnapshot(client=self.fake, hosts=hosts, local=hosts[:1],
                    device_hosts={0: hosts[0]}, handshakes={h: {} for h in hosts},
                    mapped=frozenset(), writers={})

  def worker(self, host):
    return self._worker


class Recording(FakeSidecars):
  """Records ``(phase, host, extra)`` of each stage and commit, and each replicate, in order;
  a host's writes (prepared, and the sidecars' agreement) end once ``writing`` is set (it
  is, at first)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.sent: list[tuple] = []
    self.replicated_to: list[tuple[int, list[int]]] = []
    self.writing = threading.Event()
    self.writing.set()

  def prepared(self, host, prepared):
    out: concurrent.futures.Future = concurrent.futures.Future()

    def written() -> None:
      self.writing.wait(30)
      out.set_result(FakeSidecars.prepared(self, host, prepared).result())
    if self.writing.is_set():
      written()
    else:
      threading.Thread(target=written, daemon=True).start()
    return out

  def written(self, host, final_dir):  # the sidecars' agreement learns it as late
    self.writing.wait(30)
    return super().written(host, final_dir)

  def stage(self, host, stage):
    self.sent.append(("stage", host, stage.extra))
    return super().stage(host, stage)

  def commit(self, host, commit):
    self.sent.append(("commit", host, commit.extra))
    return super().commit(host, commit)

  def await_commit(self, host, wait):
    self.sent.append(("commit", host, None))
    return super().await_commit(host, wait)

  def replicate(self, host, final_dir, targets, *, bandwidth, timeout):
    self.sent.append(("replicate", host, None))
    self.replicated_to.append((host, list(targets)))
    return super().replicate(host, final_dir, targets, bandwidth=bandwidth, timeout=timeout)
