"""ram_drop: DropRamTier sent to every sidecar at once, the answers merged (the rpc
itself: tests/server/server/test_ram_tier_drop.py, tests/processes/server/test_ram_yield.py)."""

import concurrent.futures
import types

import pytest

from sidecar._src.controller.checkpoint import ram_drop
from sidecar._src.wire.protocol import ckpt_pb

pytestmark = pytest.mark.unit


def _sidecar(directory: str, asked: list):
  """A connection whose sidecar answers it dropped step 1 of ``directory``."""
  def future(req, **kw):
    asked.append(directory)
    f = concurrent.futures.Future()
    f.set_result(ckpt_pb.DropRamTierResponse(dropped=[
        ckpt_pb.RamTierSteps(directory=directory, steps=[1], nbytes=4096)]))
    return f
  stub = types.SimpleNamespace(DropRamTier=types.SimpleNamespace(future=future))
  return types.SimpleNamespace(checkpoint=stub, metadata=(), address=f"unix:{directory}")


def test_two_sidecars_of_one_host_id_are_both_asked():
  # Pool sidecars started by hand may all be host 0: keyed by host id, only one was asked.
  asked = []
  result = ram_drop.drop([(0, _sidecar("/a", asked)), (0, _sidecar("/b", asked))],
                         ram_drop.request("/ck", None), timeout=5)
  assert sorted(asked) == ["/a", "/b"]
  assert "/a" in result.describe() and "/b" in result.describe()
