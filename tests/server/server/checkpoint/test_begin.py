"""Tier 2: a save's Begin that loses the race to another checkpointer of its directory (two
jobs, each its own sidecar) answers the documented "is being saved by another
checkpointer", not a raw ``CheckpointWriteError: Begin: FileExistsError`` (issue 63
item 5)."""

import numpy as np
import pytest

import sidecar

pytestmark = pytest.mark.server


def test_a_step_another_job_committed_meanwhile_is_refused_by_name(make_server, tmp_path):
  ours, theirs = make_server(), make_server()  # two jobs' sidecars, one directory
  directory = tmp_path / "ck"
  state = {"w": np.arange(8, dtype=np.float32)}
  with sidecar.jax.Controller([f"127.0.0.1:{ours.port}"]) as a, \
      sidecar.jax.Controller([f"127.0.0.1:{theirs.port}"]) as b, \
      a.checkpointer(directory) as mine, b.checkpointer(directory) as other:
    assert other.save(1, {"w": state["w"] + 1}).durable.result(30) == 1  # theirs won
    with pytest.raises(sidecar.PermissionDeniedError) as info:
      mine.save(1, state).durable.result(30)
    message = str(info.value)
    assert message.startswith(f"begin: step 1 of '{directory}' is being saved by another "
                              f"checkpointer, or was: step 1 is already committed at "
                              f"{directory}/1; a save never replaces a committed step")
    assert "FileExistsError" not in message and "builtins" not in message
    assert mine.save(2, state).durable.result(30) == 2  # and ours saves on
  with sidecar.jax.Controller([f"127.0.0.1:{ours.port}"]) as a, a.checkpointer(directory) as c:
    np.testing.assert_array_equal(c.restore(1, target=state)["w"], state["w"] + 1)
