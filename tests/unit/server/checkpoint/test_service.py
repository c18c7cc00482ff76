"""The Checkpoint service's errors for what a request or the disk caused: each a documented
error naming the file and the cause, never a raw class name (issue 63 item 5)."""

import errno

import pytest

from sidecar._src.core import errors
from sidecar._src.server.checkpoint import service

pytestmark = pytest.mark.unit


def test_an_oserror_with_a_message_only_crosses_with_its_message_not_its_class_name():
  # Before: "CheckpointWriteError: Commit: FileExistsError": an OSError raised with a
  # message has no strerror, and its class's name went in its place.
  e = service._documented("Commit", FileExistsError("a checkpoint is already committed at /c/7"))
  assert isinstance(e, errors.PermissionDeniedError)
  assert str(e) == ("Commit: a checkpoint is already committed at /c/7: another checkpointer "
                    "made or committed it meanwhile (two jobs saving into one directory?); save "
                    "each step of a directory from one checkpointer")
  e = service._documented("Stage", OSError("the disk went away"))
  assert isinstance(e, errors.CheckpointWriteError) and str(e) == "Stage: the disk went away"


def test_a_system_error_names_its_cause_and_file():
  e = service._documented("Stage", OSError(errno.ENOSPC, "No space left on device", "/c/1/w"))
  assert isinstance(e, errors.CheckpointWriteError)
  assert str(e) == "Stage: No space left on device (/c/1/w)" and e.errno == errno.ENOSPC
  e = service._documented("Begin", FileExistsError(errno.EEXIST, "File exists", "/c/2.tmp"))
  assert isinstance(e, errors.PermissionDeniedError)
  assert str(e).startswith("Begin: File exists (/c/2.tmp): another checkpointer made or")
  e = service._documented("Commit", OSError(errno.EIO, None))
  assert str(e) == "Commit: Input/output error" and "OSError" not in str(e)
