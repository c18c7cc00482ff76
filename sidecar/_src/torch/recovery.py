"""``sidecar.torch.Recovery``: the in-process rollback for a PyTorch training loop.

The core's rollback (``controller/recovery.Recovery``, ``sidecar.jax.Recovery``) with the
one thing a PyTorch loop keeps elsewhere: its data position. ``sidecar.torch.Checkpointer``
keeps it in the state dict (``state["data"] = loader.state_dict()``), not beside the step,
so the rollback restores the committed step into the state dict first (``dcp.load``, in
place) and then moves the DataLoader to the position that state dict now holds
(``DataLoader.seek``): a ``for`` loop over the loader goes on from there.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.recovery import Recovery as _CoreRecovery
from sidecar._src.core import errors
from sidecar._src.torch.loader import DataLoader


class Recovery(_CoreRecovery):
  """Rolls a PyTorch training loop back to the newest committed step when a step raises,
  in the same process: see ``sidecar.jax.Recovery`` for the rule (each step recovered
  ``retries_per_step`` times, then raised for the launcher to restart the process).

  Example::

    state = {"model": model.state_dict(), "optim": optim.state_dict(),
             "data": loader.state_dict()}
    recovery = sidecar.torch.Recovery(ckpt, loader, target=state)
    step = 0
    for batch in loader:
      try:
        train_step(model, optim, batch)
      except Exception as e:
        step, restored = recovery.recover(e, step=step + 1)   # loader moved back too
        model.load_state_dict(restored["model"])
        optim.load_state_dict(restored["optim"])
        continue
      step += 1
      if step % 100 == 0:
        ckpt.save(step, {"model": model.state_dict(), "optim": optim.state_dict(),
                         "data": loader.state_dict()})

  Args:
    checkpointer: the loop's ``sidecar.torch.Checkpointer``.
    loader: the loop's ``sidecar.torch.DataLoader``.
    target: the state dict ``checkpointer.restore`` loads in place (as the loop saves it,
      the DataLoader's state under ``data_key``).
    data_key: where the saved state dict keeps ``loader.state_dict()``.
    retries_per_step: how often one step that failed is recovered in this process.
  """

  public_name = "sidecar.torch.Recovery"

  def __init__(self, checkpointer: Checkpointer, loader: DataLoader, *,
               target: MutableMapping[str, Any], data_key: str = "data",
               retries_per_step: int = 1):
    super().__init__(checkpointer, loader, target=target, retries_per_step=retries_per_step)
    self._loader, self._data_key = loader, data_key

  def _restore(self, step: int) -> Any:
    """Committed step ``step`` into the target state dict, then the loader moved to the
    position it holds."""
    state = self._checkpointer.restore(step, self._target, progress=False)
    if self._data_key not in state:
      raise errors.InvalidArgumentError(
          f"the state dict restored from step {step} has no {self._data_key!r} entry (its "
          f"keys: {sorted(state)}): save the DataLoader's position in it "
          f"(state[{self._data_key!r}] = loader.state_dict()), or pass the data_key it is "
          "saved under")
    self._loader.seek(state[self._data_key])
    return state
