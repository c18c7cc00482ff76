"""The job a trainer process is part of, from its environment alone: what
``jax.distributed.initialize`` takes (``sidecar.jax.initialize``) and, by
torchrun's names, what ``sidecar.torch.connect()`` takes where torchrun set nothing; and
its name (:func:`name_of`), which holds its checkpoint directories against other jobs.

Two ways to name the job: ``SIDECAR_COORDINATOR_ADDRESS``, ``SIDECAR_NUM_PROCESSES`` and
``SIDECAR_PROCESS_ID`` (``sidecar launch`` and ``sidecar slurm batch`` set them), or a
JobSet's pod (the manifests in ``k8s/`` set ``SIDECAR_JOBSET_NAME`` and the rest): process 0's
pod is the coordinator, a pod's process id its slice times the hosts per slice plus its
host. Standard library only: a PyTorch rank imports it with no JAX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar._src.core import env as env_lib, errors

_JOBSET = (env_lib.JOBSET_NAME, env_lib.REPLICATED_JOB, env_lib.NUM_SLICES,
           env_lib.HOSTS_PER_SLICE)


def job_from_env(env: Mapping[str, str]) -> dict[str, Any] | None:
  """``jax.distributed.initialize`` arguments from ``env``; None where it names no job."""
  get = lambda name: env.get(name, "").strip()
  jobset = all(get(n) for n in _JOBSET)
  ours = [n for n in (env_lib.COORDINATOR_ADDRESS, env_lib.NUM_PROCESSES, env_lib.PROCESS_ID)
          if get(n)]
  if not ours and not jobset:
    return None
  if jobset:
    per_slice = env_lib.int_var(env, env_lib.HOSTS_PER_SLICE, None, minimum=1)
    slices = env_lib.int_var(env, env_lib.NUM_SLICES, None, minimum=1)
    subdomain = get(env_lib.SUBDOMAIN) or get(env_lib.JOBSET_NAME)
    port = env_lib.int_var(env, env_lib.COORDINATOR_PORT, env_lib.DEFAULT_COORDINATOR_PORT,
                           minimum=1)
    coordinator = get(env_lib.COORDINATOR_ADDRESS) or (
        f"{get(env_lib.JOBSET_NAME)}-{get(env_lib.REPLICATED_JOB)}-0-0.{subdomain}:{port}")
    count = env_lib.int_var(env, env_lib.NUM_PROCESSES, slices * per_slice, minimum=1)
    if get(env_lib.PROCESS_ID):
      index = env_lib.int_var(env, env_lib.PROCESS_ID, None, minimum=0)
    else:
      missing = [n for n in (env_lib.SLICE_ID, env_lib.HOST_ID) if not get(n)]
      if missing:
        raise errors.InvalidArgumentError(
            f"cannot tell this process's id: {env_lib.PROCESS_ID} is not set and neither is "
            f"{' nor '.join(missing)} (the manifests in k8s/ set both from the pod's "
            "job-index and job-completion-index annotations)")
      index = (env_lib.int_var(env, env_lib.SLICE_ID, None, minimum=0) * per_slice
               + env_lib.int_var(env, env_lib.HOST_ID, None, minimum=0))
  else:
    missing = [n for n in (env_lib.COORDINATOR_ADDRESS, env_lib.NUM_PROCESSES, env_lib.PROCESS_ID)
               if not get(n)]
    if missing == [env_lib.COORDINATOR_ADDRESS] and get(env_lib.NUM_PROCESSES) == "1":
      missing = []  # a job of one process needs no coordinator (sidecar launch sets none)
    if missing:
      raise errors.InvalidArgumentError(
          f"the environment names a jax.distributed job ({', '.join(ours)} set) but "
          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; set all three "
          "(sidecar launch does)")
    coordinator = get(env_lib.COORDINATOR_ADDRESS)
    count = env_lib.int_var(env, env_lib.NUM_PROCESSES, None, minimum=1)
    index = env_lib.int_var(env, env_lib.PROCESS_ID, None, minimum=0)
  if index >= count:
    raise errors.InvalidArgumentError(
        f"process id {index} is not below the {count} processes of the job; check "
        f"{env_lib.PROCESS_ID} / SIDECAR_SLICE_ID / SIDECAR_HOST_ID against "
        f"{env_lib.NUM_PROCESSES}")
  out: dict[str, Any] = {"coordinator_address": coordinator or None, "num_processes": count,
                         "process_id": index}
  if get(env_lib.LOCAL_DEVICES):
    out["local_devices"] = env_lib.int_var(env, env_lib.LOCAL_DEVICES, None, minimum=1)
  return out


def name_of(env: Mapping[str, str]) -> str | None:
  """The job's name from ``env``: the same in every process of one job and in its restarts,
  another in every other job (``SIDECAR_JOB``, which ``sidecar launch`` sets once per
  launch; else a Slurm job's id or a JobSet's name); None where the environment names
  none (the processes then all take process 0's random one)."""
  get = lambda name: env.get(name, "").strip()
  if get(env_lib.JOB):
    return get(env_lib.JOB)
  if get("SLURM_JOB_ID"):
    return f"slurm job {get('SLURM_JOB_ID')}"
  if get(env_lib.JOBSET_NAME):
    return f"jobset {get(env_lib.JOBSET_NAME)}"
  return None
