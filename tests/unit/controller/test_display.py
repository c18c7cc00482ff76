"""What a Controller, a feed and a checkpointer show at a prompt and in a notebook."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.controller import display
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def test_host_rows_show_an_unreachable_host_and_each_tier():
  s = pb.StatusResponse(arena_size=1 << 20, arena_used=1 << 19, arena_blocks=3, workers=1,
                        feeds=[pb.FeedStatus(pipeline="ids", batches=10, uptime_s=2.0,
                                             trainer_wait_s=0.05)],
                        checkpoints=[pb.CheckpointStatus(directory="/c", ram_steps=[4],
                                                         writing=[5], written_bytes=10,
                                                         total_bytes=20)])
  rows = display.host_rows([(0, "a:1", s), (1, "b:2", sidecar.HostLostError("gone\nmore"))])
  assert rows[0][2] == "512.0 KiB / 1.0 MiB (50%), 3 blocks"
  assert rows[0][4] == "ids: 10 batches, 5.0/s, trainer wait 5.0 ms"
  assert rows[0][5] == "/c: RAM [4], writing [5] (10 B of 20 B)"
  assert rows[1][2] == "unreachable: gone"
  html = display.html_table(display.HOST_HEADER, [["<x>", "", "", "", "", ""]])
  assert "&lt;x&gt;" in html  # escaped


@pytest.mark.processes
def test_reprs_on_a_cluster(tmp_path):
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=2, shm_size="16MiB",
                                    imports=["tests.support.feed_fns"]) as cluster, \
       cluster.controller() as ctl:
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("d",)), P("d"))
    ckpt = ctl.checkpointer(str(tmp_path))
    with ctl.feed("ids", global_batch_size=4, sharding=sh) as feed:
      batch = next(feed)
      ckpt.save(3, {"x": batch["x"]}, data_state=feed.state())
      ckpt.wait()
      text, html = repr(ctl), ctl._repr_html_()
      assert cluster.addresses[0] in text and "feeds open: 'ids'" in text
      assert re.search(r"ids: \d+ batches, [\d.]+/s, trainer wait", text)  # the sidecar's
      assert "<table>" in html and cluster.addresses[0] in html
      assert "batches: 1" in repr(feed) and "position: epoch 0, position 4" in repr(feed)
      assert "<li><b>status</b>: open</li>" in feed._repr_html_()
    text = repr(ckpt)
    assert "committed steps: [3]" in text and "durable done" in text
    assert text.splitlines()[-1].split()[:2] == ["0", "[3]"]  # host 0's RAM tier
    assert "<table>" in ckpt._repr_html_()
    ckpt.close()
    assert "state: closed" in repr(ckpt)
  assert "state: closed" in repr(ctl) and "closed" in repr(cluster)
