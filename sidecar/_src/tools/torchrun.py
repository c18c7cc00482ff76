"""The variables torchrun (torchelastic) gives each worker, by its names: what
``sidecar launch --torch`` and ``sidecar slurm batch`` give each trainer, so that
``torch.distributed.init_process_group()`` and ``sidecar.torch.connect()`` need no
arguments. Standard library only: the Slurm trainer wrapper reads it before it execs."""

from __future__ import annotations


def torchrun_env(*, rank: int, local_rank: int, world_size: int, local_world_size: int,
                 group_rank: int, group_world_size: int, master_addr: str, master_port: int,
                 restart: int = 0, max_restarts: int = 0) -> dict[str, str]:
  """The variables torchrun (torchelastic) gives each worker, by the names it uses."""
  return {
      "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
      "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(group_rank),
      "GROUP_WORLD_SIZE": str(group_world_size), "ROLE_RANK": str(rank),
      "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
      "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
      "TORCHELASTIC_RESTART_COUNT": str(restart),
      "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_RUN_ID": "none",
      # No agent hosts the store here: rank 0 serves it at MASTER_ADDR:MASTER_PORT.
      "TORCHELASTIC_USE_AGENT_STORE": "False",
  }
