"""What a Controller, a feed and a checkpointer show on a LocalCluster."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar

pytestmark = pytest.mark.processes


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
