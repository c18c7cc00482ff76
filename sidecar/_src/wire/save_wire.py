"""A save's values (``ckptfmt/save_values``) <-> their requests of the ``Checkpoint`` service.

Both sides use it: the controller's transport (``controller/checkpoint/client.py``) sends
each value with :func:`request_of`, which picks the rpc by the value's type, and reads its
answer with :func:`answer_from_pb`; the sidecar's servicer (``server/checkpoint/service.py``)
reads each request back as its value (:func:`begin_from_pb`, :func:`stage_from_pb`, which
carries a Stage's Begin as its ``begin_format``, :func:`commit_from_pb`, which gives an
:class:`~sidecar._src.ckptfmt.save_values.AwaitCommit` for a request ``taken_over``, and
:func:`prepared_from_pb`, :func:`committed_from_pb`, :func:`abort_from_pb`). This is the
only place the values' fields meet the requests'; the records they carry (leaves, shards,
plans, a format's parts) are converted by ``checkpoint_wire``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar._src.ckptfmt.save_values import (
  Abort,
  AwaitCommit,
  Begin,
  Commit,
  Committed,
  Prepared,
  SaveValue,
  Stage,
)
from sidecar._src.wire import codec
from sidecar._src.wire.checkpoint_wire import (
  COMMIT_EXTRAS,
  STAGE_EXTRAS,
  format_extra_from_pb,
  format_extra_to_pb,
  leaf_from_pb,
  leaf_to_pb,
  plan_from_pb,
  plan_to_pb,
  record_from_pb,
  record_to_pb,
  replicas_from_pb,
  replicas_to_pb,
  staged_from_pb,
  staged_to_pb,
)
from sidecar._src.wire.protocol import ckpt_pb


def begin_to_pb(begin: Begin, *, worker_session: str) -> ckpt_pb.CheckpointBeginRequest:
  """``begin`` as a Begin request of the trainer whose worker session is
  ``worker_session`` (empty: none)."""
  return ckpt_pb.CheckpointBeginRequest(directory=begin.directory, step=begin.step,
                                        format=begin.format, worker_session=worker_session)


def begin_from_pb(request: ckpt_pb.CheckpointBeginRequest) -> Begin:
  """A Begin request's :class:`Begin`. The request's ``worker_session`` is the caller's,
  not the value's: the servicer reads it itself."""
  return Begin(request.directory, request.step, request.format)


def stage_to_pb(stage: Stage, *, worker_session: str, to_arena: codec.ToArena | None
                ) -> ckpt_pb.CheckpointStageRequest:
  """``stage`` as a Stage request of the trainer whose worker session is
  ``worker_session`` (empty: none); its shards' bytes as :func:`staged_to_pb` puts them."""
  request = ckpt_pb.CheckpointStageRequest(
      directory=stage.directory, step=stage.step, tmp_dir=stage.tmp_dir,
      final_dir=stage.final_dir, leaves=[leaf_to_pb(d) for d in stage.leaves],
      last=stage.last, writers=stage.writers, worker_session=worker_session,
      begin_format=stage.begin.format if stage.begin is not None else "")
  if stage.plan is not None:
    plan_to_pb(request.plan, stage.plan)
  format_extra_to_pb(request, stage.extra, STAGE_EXTRAS)
  staged_to_pb(request, stage.shards, to_arena)
  return request


def stage_from_pb(request: ckpt_pb.CheckpointStageRequest, from_arena: codec.FromArena | None,
                  views: Sequence[memoryview] = ()) -> Stage:
  """A Stage request's :class:`Stage` (its shards as :func:`staged_from_pb` reads them;
  ``writers`` at least 1; its ``begin`` the Begin of its directory and step in its
  ``begin_format``, if it names one). The request's ``worker_session`` is the caller's, not the
  value's: the servicer reads it itself."""
  leaves = [leaf_from_pb(leaf, f"leaves[{i}]") for i, leaf in enumerate(request.leaves)]
  extra = format_extra_from_pb(request, STAGE_EXTRAS)
  shards = staged_from_pb(request, from_arena, views)
  plan = plan_from_pb(request.plan, "plan") if request.HasField("plan") else None
  begin = (Begin(request.directory, request.step, request.begin_format)
           if request.begin_format else None)
  return Stage(directory=request.directory, step=request.step, tmp_dir=request.tmp_dir,
               final_dir=request.final_dir, leaves=leaves, shards=shards, last=request.last,
               writers=max(request.writers, 1), extra=extra, plan=plan, begin=begin)


def commit_to_pb(commit: Commit | AwaitCommit) -> ckpt_pb.CheckpointCommitRequest:
  """``commit`` as a Commit request; the wait for the sidecars' commit as one
  ``taken_over`` (only its ``tmp_dir`` and ``step`` count)."""
  if isinstance(commit, AwaitCommit):
    return ckpt_pb.CheckpointCommitRequest(tmp_dir=commit.tmp_dir, step=commit.step,
                                           num_hosts=1, whole_step=True, taken_over=True)
  request = ckpt_pb.CheckpointCommitRequest(
      tmp_dir=commit.tmp_dir, step=commit.step, num_hosts=commit.num_hosts,
      leaves=[leaf_to_pb(d) for d in commit.leaves],
      records=[record_to_pb(c) for c in commit.shards],
      data_state_json=commit.data_state_json, whole_step=commit.whole_step)
  format_extra_to_pb(request, commit.extra, COMMIT_EXTRAS)
  replicas_to_pb(request.replicas, commit.replicas)
  return request


def commit_from_pb(request: ckpt_pb.CheckpointCommitRequest) -> Commit | AwaitCommit:
  """A Commit request's :class:`Commit` (``replicas`` None where it names none), or the
  :class:`AwaitCommit` of one ``taken_over``."""
  if request.taken_over:
    return AwaitCommit(request.tmp_dir, request.step)
  leaves = [leaf_from_pb(leaf, f"leaves[{i}]") for i, leaf in enumerate(request.leaves)]
  written = [record_from_pb(c, f"records[{i}]") for i, c in enumerate(request.records)]
  return Commit(tmp_dir=request.tmp_dir, step=request.step, num_hosts=request.num_hosts,
                shards=written, leaves=leaves, data_state_json=request.data_state_json,
                whole_step=request.whole_step,
                replicas=replicas_from_pb(request.replicas) or None,
                extra=format_extra_from_pb(request, COMMIT_EXTRAS))


def prepared_from_pb(request: ckpt_pb.CheckpointPreparedRequest) -> Prepared:
  return Prepared(request.final_dir, request.timeout_s)


def committed_from_pb(request: ckpt_pb.CheckpointCommittedRequest) -> Committed:
  return Committed(request.final_dir, request.manifest_json)


def abort_from_pb(request: ckpt_pb.CheckpointAbortRequest) -> Abort:
  return Abort(request.tmp_dir, request.final_dir)


def request_of(value: SaveValue, *, worker_session: str = "",
               to_arena: codec.ToArena | None = None) -> tuple[str, Any]:
  """The rpc's name and request that send ``value``, by the value's type (the transport's
  one call, ``CheckpointTransport.send``). ``worker_session``: the trainer's worker
  session (empty: none), which a Begin and a Stage carry; ``to_arena``: a Stage's shards'
  blocks, as :func:`staged_to_pb` puts them."""
  match value:
    case Begin():
      return "Begin", begin_to_pb(value, worker_session=worker_session)
    case Stage():
      return "Stage", stage_to_pb(value, worker_session=worker_session, to_arena=to_arena)
    case Prepared():
      return "Prepared", ckpt_pb.CheckpointPreparedRequest(final_dir=value.final_dir,
                                                           timeout_s=value.timeout_s)
    case Commit() | AwaitCommit():
      return "Commit", commit_to_pb(value)
    case Committed():
      return "Committed", ckpt_pb.CheckpointCommittedRequest(
          final_dir=value.final_dir, manifest_json=value.manifest_json)
    case Abort():
      return "Abort", ckpt_pb.CheckpointAbortRequest(tmp_dir=value.tmp_dir,
                                                     final_dir=value.final_dir)
  raise TypeError(f"a save sends the values of ckptfmt/save_values, got {value!r:.200}")


def answer_from_pb(value: SaveValue, response: Any) -> Any:
  """The answer to ``value`` in its rpc's ``response`` (``ckptfmt/save_values`` says
  what each value's is)."""
  match value:
    case Begin():
      return response.tmp_directory
    case Stage():
      return response.staged_bytes
    case Prepared():
      return [record_from_pb(c, f"records[{i}]") for i, c in enumerate(response.records)]
    case Committed():
      return list(response.kept_steps)
  return response.committed  # a Commit's, an AwaitCommit's, an Abort's
