from sidecar.v1 import sidecar_pb2 as _sidecar_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgreePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGREE_UNKNOWN: _ClassVar[AgreePhase]
    AGREE_TAKEN_OVER: _ClassVar[AgreePhase]
    AGREE_WRITTEN: _ClassVar[AgreePhase]
    AGREE_FAILED: _ClassVar[AgreePhase]
    AGREE_COMMITTED: _ClassVar[AgreePhase]
    AGREE_ABANDONED: _ClassVar[AgreePhase]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_ANY: _ClassVar[Tier]
    TIER_RAM: _ClassVar[Tier]
    TIER_REPLICA: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
AGREE_UNKNOWN: AgreePhase
AGREE_TAKEN_OVER: AgreePhase
AGREE_WRITTEN: AgreePhase
AGREE_FAILED: AgreePhase
AGREE_COMMITTED: AgreePhase
AGREE_ABANDONED: AgreePhase
TIER_ANY: Tier
TIER_RAM: Tier
TIER_REPLICA: Tier
TIER_DISK: Tier

class KeyEntry(_message.Message):
    __slots__ = ("key", "index")
    KEY_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    key: str
    index: int
    def __init__(self, key: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class Interval(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class ShardId(_message.Message):
    __slots__ = ("key_path", "index")
    KEY_PATH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    key_path: _containers.RepeatedCompositeFieldContainer[KeyEntry]
    index: _containers.RepeatedCompositeFieldContainer[Interval]
    def __init__(self, key_path: _Optional[_Iterable[_Union[KeyEntry, _Mapping]]] = ..., index: _Optional[_Iterable[_Union[Interval, _Mapping]]] = ...) -> None: ...

class LeafSpec(_message.Message):
    __slots__ = ("key_path", "shape", "dtype", "kind", "write_shape", "sharding")
    KEY_PATH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WRITE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    key_path: _containers.RepeatedCompositeFieldContainer[KeyEntry]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    kind: str
    write_shape: _containers.RepeatedScalarFieldContainer[int]
    sharding: str
    def __init__(self, key_path: _Optional[_Iterable[_Union[KeyEntry, _Mapping]]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., kind: _Optional[str] = ..., write_shape: _Optional[_Iterable[int]] = ..., sharding: _Optional[str] = ...) -> None: ...

class ShardRecord(_message.Message):
    __slots__ = ("shard", "nbytes", "crc32c", "host", "leaf", "dtype", "shape", "rank")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LEAF_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    shard: ShardId
    nbytes: int
    crc32c: int
    host: int
    leaf: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    def __init__(self, shard: _Optional[_Union[ShardId, _Mapping]] = ..., nbytes: _Optional[int] = ..., crc32c: _Optional[int] = ..., host: _Optional[int] = ..., leaf: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ...) -> None: ...

class ShardData(_message.Message):
    __slots__ = ("arena", "array")
    ARENA_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    arena: _sidecar_pb2.ArenaRef
    array: _sidecar_pb2.Array
    def __init__(self, arena: _Optional[_Union[_sidecar_pb2.ArenaRef, _Mapping]] = ..., array: _Optional[_Union[_sidecar_pb2.Array, _Mapping]] = ...) -> None: ...

class HostIds(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hosts: _Optional[_Iterable[int]] = ...) -> None: ...

class DcpPart(_message.Message):
    __slots__ = ("rank", "item_count")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ITEM_COUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    item_count: int
    def __init__(self, rank: _Optional[int] = ..., item_count: _Optional[int] = ...) -> None: ...

class DcpCommit(_message.Message):
    __slots__ = ("metadata", "file_sizes", "plan_json")
    class FileSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    METADATA_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZES_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    metadata: bytes
    file_sizes: _containers.ScalarMap[int, int]
    plan_json: str
    def __init__(self, metadata: _Optional[bytes] = ..., file_sizes: _Optional[_Mapping[int, int]] = ..., plan_json: _Optional[str] = ...) -> None: ...

class CommitPlan(_message.Message):
    __slots__ = ("save", "committer", "hosts", "data_state_json", "lead", "replicas")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: HostIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[HostIds, _Mapping]] = ...) -> None: ...
    SAVE_FIELD_NUMBER: _ClassVar[int]
    COMMITTER_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    DATA_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    LEAD_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    save: str
    committer: int
    hosts: _containers.RepeatedScalarFieldContainer[int]
    data_state_json: str
    lead: bool
    replicas: _containers.MessageMap[int, HostIds]
    def __init__(self, save: _Optional[str] = ..., committer: _Optional[int] = ..., hosts: _Optional[_Iterable[int]] = ..., data_state_json: _Optional[str] = ..., lead: _Optional[bool] = ..., replicas: _Optional[_Mapping[int, HostIds]] = ...) -> None: ...

class CheckpointOpenRequest(_message.Message):
    __slots__ = ("directory", "ram_steps", "ram_budget", "sweep", "job", "holder", "worker_session")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    WORKER_SESSION_FIELD_NUMBER: _ClassVar[int]
    directory: str
    ram_steps: int
    ram_budget: int
    sweep: bool
    job: str
    holder: str
    worker_session: str
    def __init__(self, directory: _Optional[str] = ..., ram_steps: _Optional[int] = ..., ram_budget: _Optional[int] = ..., sweep: _Optional[bool] = ..., job: _Optional[str] = ..., holder: _Optional[str] = ..., worker_session: _Optional[str] = ...) -> None: ...

class CheckpointOpenResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointBeginRequest(_message.Message):
    __slots__ = ("directory", "step", "format", "worker_session")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_SESSION_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    format: str
    worker_session: str
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ..., format: _Optional[str] = ..., worker_session: _Optional[str] = ...) -> None: ...

class CheckpointBeginResponse(_message.Message):
    __slots__ = ("tmp_directory",)
    TMP_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    tmp_directory: str
    def __init__(self, tmp_directory: _Optional[str] = ...) -> None: ...

class CheckpointStageRequest(_message.Message):
    __slots__ = ("directory", "step", "tmp_dir", "final_dir", "leaves", "records", "data", "last", "worker_session", "writers", "dcp", "plan", "begin_format")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TMP_DIR_FIELD_NUMBER: _ClassVar[int]
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    WORKER_SESSION_FIELD_NUMBER: _ClassVar[int]
    WRITERS_FIELD_NUMBER: _ClassVar[int]
    DCP_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FORMAT_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    tmp_dir: str
    final_dir: str
    leaves: _containers.RepeatedCompositeFieldContainer[LeafSpec]
    records: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    data: _containers.RepeatedCompositeFieldContainer[ShardData]
    last: bool
    worker_session: str
    writers: int
    dcp: DcpPart
    plan: CommitPlan
    begin_format: str
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ..., tmp_dir: _Optional[str] = ..., final_dir: _Optional[str] = ..., leaves: _Optional[_Iterable[_Union[LeafSpec, _Mapping]]] = ..., records: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ..., data: _Optional[_Iterable[_Union[ShardData, _Mapping]]] = ..., last: _Optional[bool] = ..., worker_session: _Optional[str] = ..., writers: _Optional[int] = ..., dcp: _Optional[_Union[DcpPart, _Mapping]] = ..., plan: _Optional[_Union[CommitPlan, _Mapping]] = ..., begin_format: _Optional[str] = ...) -> None: ...

class CheckpointStageResponse(_message.Message):
    __slots__ = ("staged_bytes",)
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    staged_bytes: int
    def __init__(self, staged_bytes: _Optional[int] = ...) -> None: ...

class CheckpointPreparedRequest(_message.Message):
    __slots__ = ("final_dir", "timeout_s")
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    final_dir: str
    timeout_s: float
    def __init__(self, final_dir: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CheckpointPreparedResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ...) -> None: ...

class CheckpointCommitRequest(_message.Message):
    __slots__ = ("tmp_dir", "step", "num_hosts", "leaves", "records", "data_state_json", "whole_step", "replicas", "dcp", "taken_over")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: HostIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[HostIds, _Mapping]] = ...) -> None: ...
    TMP_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DATA_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    WHOLE_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DCP_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_FIELD_NUMBER: _ClassVar[int]
    tmp_dir: str
    step: int
    num_hosts: int
    leaves: _containers.RepeatedCompositeFieldContainer[LeafSpec]
    records: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    data_state_json: str
    whole_step: bool
    replicas: _containers.MessageMap[int, HostIds]
    dcp: DcpCommit
    taken_over: bool
    def __init__(self, tmp_dir: _Optional[str] = ..., step: _Optional[int] = ..., num_hosts: _Optional[int] = ..., leaves: _Optional[_Iterable[_Union[LeafSpec, _Mapping]]] = ..., records: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ..., data_state_json: _Optional[str] = ..., whole_step: _Optional[bool] = ..., replicas: _Optional[_Mapping[int, HostIds]] = ..., dcp: _Optional[_Union[DcpCommit, _Mapping]] = ..., taken_over: _Optional[bool] = ...) -> None: ...

class CheckpointCommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: str
    def __init__(self, committed: _Optional[str] = ...) -> None: ...

class CheckpointCommittedRequest(_message.Message):
    __slots__ = ("final_dir", "manifest_json")
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    final_dir: str
    manifest_json: str
    def __init__(self, final_dir: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class CheckpointCommittedResponse(_message.Message):
    __slots__ = ("kept_steps",)
    KEPT_STEPS_FIELD_NUMBER: _ClassVar[int]
    kept_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kept_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointAbortRequest(_message.Message):
    __slots__ = ("tmp_dir", "final_dir")
    TMP_DIR_FIELD_NUMBER: _ClassVar[int]
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    tmp_dir: str
    final_dir: str
    def __init__(self, tmp_dir: _Optional[str] = ..., final_dir: _Optional[str] = ...) -> None: ...

class CheckpointAbortResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: str
    def __init__(self, committed: _Optional[str] = ...) -> None: ...

class CheckpointDeleteRequest(_message.Message):
    __slots__ = ("directory", "step", "set_aside")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SET_ASIDE_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    set_aside: bool
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ..., set_aside: _Optional[bool] = ...) -> None: ...

class CheckpointDeleteResponse(_message.Message):
    __slots__ = ("set_aside_as",)
    SET_ASIDE_AS_FIELD_NUMBER: _ClassVar[int]
    set_aside_as: str
    def __init__(self, set_aside_as: _Optional[str] = ...) -> None: ...

class CheckpointForgetRequest(_message.Message):
    __slots__ = ("directory", "step")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointForgetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DropRamTierRequest(_message.Message):
    __slots__ = ("directory", "tenant")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    directory: str
    tenant: str
    def __init__(self, directory: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class RamTierSteps(_message.Message):
    __slots__ = ("directory", "steps", "nbytes")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    directory: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, directory: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class DropRamTierResponse(_message.Message):
    __slots__ = ("dropped", "kept")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    dropped: _containers.RepeatedCompositeFieldContainer[RamTierSteps]
    kept: _containers.RepeatedCompositeFieldContainer[RamTierSteps]
    def __init__(self, dropped: _Optional[_Iterable[_Union[RamTierSteps, _Mapping]]] = ..., kept: _Optional[_Iterable[_Union[RamTierSteps, _Mapping]]] = ...) -> None: ...

class CheckpointReplicateRequest(_message.Message):
    __slots__ = ("final_dir", "hosts", "timeout_s", "bandwidth")
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    final_dir: str
    hosts: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    bandwidth: int
    def __init__(self, final_dir: _Optional[str] = ..., hosts: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ..., bandwidth: _Optional[int] = ...) -> None: ...

class CheckpointReplicateResponse(_message.Message):
    __slots__ = ("peers", "shards", "bytes", "seconds")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[int]
    shards: int
    bytes: int
    seconds: float
    def __init__(self, peers: _Optional[_Iterable[int]] = ..., shards: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("directory", "step", "final_dir", "source", "tenant")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    final_dir: str
    source: int
    tenant: str
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ..., final_dir: _Optional[str] = ..., source: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class ReplicaBlock(_message.Message):
    __slots__ = ("record", "data")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    record: ShardRecord
    data: _sidecar_pb2.ArenaRef
    def __init__(self, record: _Optional[_Union[ShardRecord, _Mapping]] = ..., data: _Optional[_Union[_sidecar_pb2.ArenaRef, _Mapping]] = ...) -> None: ...

class ReplicaPart(_message.Message):
    __slots__ = ("record", "offset", "data")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    record: ShardRecord
    offset: int
    data: bytes
    def __init__(self, record: _Optional[_Union[ShardRecord, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("header", "worker_session", "blocks", "part", "done")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    WORKER_SESSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    worker_session: str
    blocks: _containers.RepeatedCompositeFieldContainer[ReplicaBlock]
    part: ReplicaPart
    done: bool
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., worker_session: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[ReplicaBlock, _Mapping]]] = ..., part: _Optional[_Union[ReplicaPart, _Mapping]] = ..., done: _Optional[bool] = ...) -> None: ...

class ReceiveResponse(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class AgreeState(_message.Message):
    __slots__ = ("final_dir", "save", "step", "host", "phase", "records", "error", "committed", "written", "plan", "directory", "format")
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    final_dir: str
    save: str
    step: int
    host: int
    phase: AgreePhase
    records: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    error: _sidecar_pb2.Error
    committed: str
    written: _containers.RepeatedScalarFieldContainer[int]
    plan: CommitPlan
    directory: str
    format: str
    def __init__(self, final_dir: _Optional[str] = ..., save: _Optional[str] = ..., step: _Optional[int] = ..., host: _Optional[int] = ..., phase: _Optional[_Union[AgreePhase, str]] = ..., records: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ..., error: _Optional[_Union[_sidecar_pb2.Error, _Mapping]] = ..., committed: _Optional[str] = ..., written: _Optional[_Iterable[int]] = ..., plan: _Optional[_Union[CommitPlan, _Mapping]] = ..., directory: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class CheckpointHeldRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class ShardIds(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardId]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardId, _Mapping]]] = ...) -> None: ...

class HeldReplicas(_message.Message):
    __slots__ = ("by_source",)
    class BySourceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ShardIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ShardIds, _Mapping]] = ...) -> None: ...
    BY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    by_source: _containers.MessageMap[int, ShardIds]
    def __init__(self, by_source: _Optional[_Mapping[int, ShardIds]] = ...) -> None: ...

class CheckpointHeldResponse(_message.Message):
    __slots__ = ("own", "replicas")
    class OwnEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ShardIds
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ShardIds, _Mapping]] = ...) -> None: ...
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: HeldReplicas
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[HeldReplicas, _Mapping]] = ...) -> None: ...
    OWN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    own: _containers.MessageMap[str, ShardIds]
    replicas: _containers.MessageMap[str, HeldReplicas]
    def __init__(self, own: _Optional[_Mapping[str, ShardIds]] = ..., replicas: _Optional[_Mapping[str, HeldReplicas]] = ...) -> None: ...

class CheckpointInfoRequest(_message.Message):
    __slots__ = ("final_dir", "taken_over")
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_FIELD_NUMBER: _ClassVar[int]
    final_dir: str
    taken_over: bool
    def __init__(self, final_dir: _Optional[str] = ..., taken_over: _Optional[bool] = ...) -> None: ...

class CheckpointInfoResponse(_message.Message):
    __slots__ = ("format", "leaves", "shards", "data_state_json", "replicas", "extras_json", "step")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: HostIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[HostIds, _Mapping]] = ...) -> None: ...
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    DATA_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    format: str
    leaves: _containers.RepeatedCompositeFieldContainer[LeafSpec]
    shards: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    data_state_json: str
    replicas: _containers.MessageMap[int, HostIds]
    extras_json: str
    step: int
    def __init__(self, format: _Optional[str] = ..., leaves: _Optional[_Iterable[_Union[LeafSpec, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ..., data_state_json: _Optional[str] = ..., replicas: _Optional[_Mapping[int, HostIds]] = ..., extras_json: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "nbytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CheckpointReadRequest(_message.Message):
    __slots__ = ("final_dir", "record", "tier", "part", "worker_session", "unchecked")
    FINAL_DIR_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WORKER_SESSION_FIELD_NUMBER: _ClassVar[int]
    UNCHECKED_FIELD_NUMBER: _ClassVar[int]
    final_dir: str
    record: ShardRecord
    tier: Tier
    part: ByteRange
    worker_session: str
    unchecked: bool
    def __init__(self, final_dir: _Optional[str] = ..., record: _Optional[_Union[ShardRecord, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., part: _Optional[_Union[ByteRange, _Mapping]] = ..., worker_session: _Optional[str] = ..., unchecked: _Optional[bool] = ...) -> None: ...

class CheckpointReadResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: ShardData
    def __init__(self, data: _Optional[_Union[ShardData, _Mapping]] = ...) -> None: ...
