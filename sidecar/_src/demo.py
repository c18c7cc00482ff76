"""``sidecar demo``: a LocalCluster moving batches through shared memory into jax.Arrays."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sidecar._src.local import LocalCluster

DEMO_MODULE = "sidecar._src.demo_functions"


def run(*, hosts: int = 2, devices_per_host: int = 2, steps: int = 20, batch_size: int = 32) -> int:
  """Runs the demo; returns a process exit code."""
  print(f"Starting a LocalCluster: {hosts} sidecar processes, {devices_per_host} CPU devices each.")
  t0 = time.perf_counter()
  with LocalCluster(hosts, devices_per_host, shm_size="256MiB", imports=[DEMO_MODULE]) as cluster:
    with cluster.controller() as ctl:
      started = time.perf_counter() - t0
      for h in ctl.hosts:
        print(f"  host {h.host_id}: {h.address} pid {h.pid}, devices {list(h.device_ids)}, "
              f"functions {list(h.functions)}")
      mesh = Mesh(np.array(jax.devices()[:hosts * devices_per_host]), ("data",))
      sharding = NamedSharding(mesh, P("data"))
      per_host = batch_size * devices_per_host
      global_shape = (per_host * hosts, 224, 224, 3)
      nbytes, waits, total = 0, [], 0.0
      for step in range(steps):
        t = time.perf_counter()
        futures = [ctl.call_async("make_batch", h, step, batch_size=per_host, hosts=[h])[0]
                   for h in range(hosts)]
        parts = [f.result() for f in futures]
        shards = []
        for h, part in enumerate(parts):
          for i, d in enumerate(cluster.devices(h)):
            shards.append(jax.device_put(part["images"][i * batch_size:(i + 1) * batch_size], d))
        images = jax.make_array_from_single_device_arrays(global_shape, sharding, shards)
        waits.append(time.perf_counter() - t)
        total += float(jnp.mean(images, dtype=jnp.float32))
        nbytes += sum(p["images"].nbytes for p in parts)
      wait = np.array(waits[1:]) * 1e3
      print(f"Sidecars ready in {started:.2f} s.")
      print(f"{steps} global batches {global_shape} uint8 ({nbytes / steps / 1e6:.1f} MB each) "
            f"through shared memory into a jax.Array sharded over {mesh.devices.size} devices.")
      print(f"  wait per batch: p50 {np.median(wait):.2f} ms, max {wait.max():.2f} ms; "
            f"{nbytes / sum(waits) / 1e9:.2f} GB/s; mean pixel {total / steps:.2f}")
      arena = ctl.status()
      print("  arena use after the run: " + ", ".join(
          f"host {s.identity.host_id} {s.arena_used >> 20} MiB in {s.arena_blocks} blocks"
          for s in arena))
  print("Done: every sidecar stopped, no shared memory left behind.")
  return 0
