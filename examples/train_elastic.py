# examples/train_elastic.py: training that goes on when a host dies. From examples/:
# python train_elastic.py /tmp/ckpt/elastic   (3 hosts in a LocalCluster; at step 25 one
# host's sidecar is SIGKILLed, and training goes on on the other two from the last save)
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar

directory = sys.argv[1]
STEPS, LOSE_A_HOST_AT = 60, 25


def abstract_state(mesh):
  rows = NamedSharding(mesh, P("data"))
  return {"w": jax.ShapeDtypeStruct((48,), jnp.float32, sharding=rows)}


def init(mesh):
  return jax.jit(lambda: {"w": jnp.zeros(48)},
                 out_shardings={"w": NamedSharding(mesh, P("data"))})()


@jax.jit
def train_step(state, batch):      # any jitted step; here, a running sum
  return {"w": state["w"] + batch["image"].mean(axis=(1, 2, 3)) + batch["label"]}


# 3 hosts x 2 CPU devices here; on real hosts, sidecar.jax.Controller(addresses) or .from_env()
cluster = sidecar.testing.LocalCluster(num_hosts=3, devices_per_host=2,
                                       imports=["quickstart_fns"]).start()
ctl = cluster.controller()


def lose_a_host(step, hosts):      # the demonstration: host 2's sidecar dies, once
  if step == LOSE_A_HOST_AT and 2 in hosts:
    cluster.kill(2)


ckpt = ctl.checkpointer(directory, max_to_keep=2, replicas=1)  # follows the live hosts


@sidecar.elastic.retry(ctl, min_hosts=2)
def train(hosts):
  mesh = Mesh(np.array(sidecar.elastic.devices(ctl, hosts)), ("data",))
  start = ckpt.latest_step()
  print(f"hosts {hosts}: " + (f"resuming after step {start}, the last saved"
                              if start is not None else "starting at step 0"))
  with sidecar.elastic.phase("restore"):       # timed, as an event
    state = ckpt.restore(target=abstract_state(mesh)) if start is not None else init(mesh)
  with ctl.feed("images", global_batch_size=48, sharding=NamedSharding(mesh, P("data")),
                state=ckpt.data_state() if start is not None else None) as feed:
    for step, batch in zip(range(0 if start is None else start + 1, STEPS), feed):
      lose_a_host(step, hosts)
      state = train_step(state, batch)
      if step % 10 == 9:
        ckpt.save(step, state, data_state=feed.state())
  return state, step


try:
  state, step = train()          # on every live host; after a loss, on the survivors
  ckpt.close()                   # waits for the last save
  for event in train.events:     # start, host_lost, retry, phase, done: timed
    print(f"{event.kind}: {event.detail}"
          + (f" ({event.seconds:.2f} s)" if event.seconds is not None else ""))
  print(f"trained to step {step} on hosts {[h.host_id for h in ctl.hosts]}")
finally:
  ctl.close()
  cluster.close()
