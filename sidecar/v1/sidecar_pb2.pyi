from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HostIdentity(_message.Message):
    __slots__ = ("host_id", "slice_id", "device_ids", "hostname", "pid", "boot_id", "process_index", "pid_namespace")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    host_id: int
    slice_id: int
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    hostname: str
    pid: int
    boot_id: str
    process_index: int
    pid_namespace: str
    def __init__(self, host_id: _Optional[int] = ..., slice_id: _Optional[int] = ..., device_ids: _Optional[_Iterable[int]] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., boot_id: _Optional[str] = ..., process_index: _Optional[int] = ..., pid_namespace: _Optional[str] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("protocol", "package", "python", "numpy", "jax")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    NUMPY_FIELD_NUMBER: _ClassVar[int]
    JAX_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    package: str
    python: str
    numpy: str
    jax: str
    def __init__(self, protocol: _Optional[int] = ..., package: _Optional[str] = ..., python: _Optional[str] = ..., numpy: _Optional[str] = ..., jax: _Optional[str] = ...) -> None: ...

class RegistryEntry(_message.Message):
    __slots__ = ("kind", "name", "code_hash")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODE_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    code_hash: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., code_hash: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("versions", "client", "ticket")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    versions: Versions
    client: str
    ticket: bool
    def __init__(self, versions: _Optional[_Union[Versions, _Mapping]] = ..., client: _Optional[str] = ..., ticket: _Optional[bool] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("versions", "identity", "registry", "registry_fingerprint", "session", "worker_socket", "arena_size", "tenant", "ticket")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    versions: Versions
    identity: HostIdentity
    registry: _containers.RepeatedCompositeFieldContainer[RegistryEntry]
    registry_fingerprint: str
    session: str
    worker_socket: str
    arena_size: int
    tenant: str
    ticket: str
    def __init__(self, versions: _Optional[_Union[Versions, _Mapping]] = ..., identity: _Optional[_Union[HostIdentity, _Mapping]] = ..., registry: _Optional[_Iterable[_Union[RegistryEntry, _Mapping]]] = ..., registry_fingerprint: _Optional[str] = ..., session: _Optional[str] = ..., worker_socket: _Optional[str] = ..., arena_size: _Optional[int] = ..., tenant: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data", "scalar")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scalar: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scalar: _Optional[bool] = ...) -> None: ...

class ArenaRef(_message.Message):
    __slots__ = ("offset", "nbytes", "generation", "dtype", "shape")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    generation: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., generation: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ListValue(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class DictEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: Value
    value: Value
    def __init__(self, key: _Optional[_Union[Value, _Mapping]] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class DictValue(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DictEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[DictEntry, _Mapping]]] = ...) -> None: ...

class NamedTupleValue(_message.Message):
    __slots__ = ("module", "qualname", "fields", "items")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    QUALNAME_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    module: str
    qualname: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, module: _Optional[str] = ..., qualname: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ..., items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("none", "bool_value", "int_value", "big_int", "float_value", "str_value", "bytes_value", "array", "arena", "list", "tuple", "dict", "named_tuple")
    NONE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BIG_INT_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STR_VALUE_FIELD_NUMBER: _ClassVar[int]
    BYTES_VALUE_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    NAMED_TUPLE_FIELD_NUMBER: _ClassVar[int]
    none: bool
    bool_value: bool
    int_value: int
    big_int: str
    float_value: float
    str_value: str
    bytes_value: bytes
    array: Array
    arena: ArenaRef
    list: ListValue
    tuple: ListValue
    dict: DictValue
    named_tuple: NamedTupleValue
    def __init__(self, none: _Optional[bool] = ..., bool_value: _Optional[bool] = ..., int_value: _Optional[int] = ..., big_int: _Optional[str] = ..., float_value: _Optional[float] = ..., str_value: _Optional[str] = ..., bytes_value: _Optional[bytes] = ..., array: _Optional[_Union[Array, _Mapping]] = ..., arena: _Optional[_Union[ArenaRef, _Mapping]] = ..., list: _Optional[_Union[ListValue, _Mapping]] = ..., tuple: _Optional[_Union[ListValue, _Mapping]] = ..., dict: _Optional[_Union[DictValue, _Mapping]] = ..., named_tuple: _Optional[_Union[NamedTupleValue, _Mapping]] = ...) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("name", "args", "kwargs", "worker_session", "feed", "timeout_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_SESSION_FIELD_NUMBER: _ClassVar[int]
    FEED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    args: Value
    kwargs: Value
    worker_session: str
    feed: FeedSpec
    timeout_s: float
    def __init__(self, name: _Optional[str] = ..., args: _Optional[_Union[Value, _Mapping]] = ..., kwargs: _Optional[_Union[Value, _Mapping]] = ..., worker_session: _Optional[str] = ..., feed: _Optional[_Union[FeedSpec, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CallPart(_message.Message):
    __slots__ = ("total", "data")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total: int
    data: bytes
    def __init__(self, total: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class FeedSpec(_message.Message):
    __slots__ = ("global_batch_size", "rows", "seed", "num_epochs", "shard_index", "shard_count", "state_json", "workers", "length_only", "replay")
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_ONLY_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    global_batch_size: int
    rows: _containers.RepeatedCompositeFieldContainer[RowRange]
    seed: int
    num_epochs: int
    shard_index: int
    shard_count: int
    state_json: str
    workers: int
    length_only: bool
    replay: int
    def __init__(self, global_batch_size: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowRange, _Mapping]]] = ..., seed: _Optional[int] = ..., num_epochs: _Optional[int] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., state_json: _Optional[str] = ..., workers: _Optional[int] = ..., length_only: _Optional[bool] = ..., replay: _Optional[int] = ...) -> None: ...

class CallResponse(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: Value
    error: Error
    def __init__(self, result: _Optional[_Union[Value, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("start", "credit", "prefetch", "freed", "wait_s", "close", "saved_state_json")
    START_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    SAVED_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    start: CallRequest
    credit: int
    prefetch: int
    freed: _containers.RepeatedScalarFieldContainer[int]
    wait_s: float
    close: bool
    saved_state_json: str
    def __init__(self, start: _Optional[_Union[CallRequest, _Mapping]] = ..., credit: _Optional[int] = ..., prefetch: _Optional[int] = ..., freed: _Optional[_Iterable[int]] = ..., wait_s: _Optional[float] = ..., close: _Optional[bool] = ..., saved_state_json: _Optional[str] = ...) -> None: ...

class StreamItem(_message.Message):
    __slots__ = ("value", "index", "error", "end", "batch")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    value: Value
    index: int
    error: Error
    end: bool
    batch: FeedBatch
    def __init__(self, value: _Optional[_Union[Value, _Mapping]] = ..., index: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., end: _Optional[bool] = ..., batch: _Optional[_Union[FeedBatch, _Mapping]] = ...) -> None: ...

class FeedBatch(_message.Message):
    __slots__ = ("structure", "leaves", "state_json", "produce_s")
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    PRODUCE_S_FIELD_NUMBER: _ClassVar[int]
    structure: Value
    leaves: _containers.RepeatedCompositeFieldContainer[FeedLeaf]
    state_json: str
    produce_s: float
    def __init__(self, structure: _Optional[_Union[Value, _Mapping]] = ..., leaves: _Optional[_Iterable[_Union[FeedLeaf, _Mapping]]] = ..., state_json: _Optional[str] = ..., produce_s: _Optional[float] = ...) -> None: ...

class FeedLeaf(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, parts: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("type", "message", "traceback", "errno", "path", "host_id")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    ERRNO_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    traceback: str
    errno: int
    path: str
    host_id: int
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., errno: _Optional[int] = ..., path: _Optional[str] = ..., host_id: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeedStatus(_message.Message):
    __slots__ = ("pipeline", "batches", "uptime_s", "produce_s", "backpressure_s", "trainer_wait_s", "workers")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PRODUCE_S_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_S_FIELD_NUMBER: _ClassVar[int]
    TRAINER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    batches: int
    uptime_s: float
    produce_s: float
    backpressure_s: float
    trainer_wait_s: float
    workers: int
    def __init__(self, pipeline: _Optional[str] = ..., batches: _Optional[int] = ..., uptime_s: _Optional[float] = ..., produce_s: _Optional[float] = ..., backpressure_s: _Optional[float] = ..., trainer_wait_s: _Optional[float] = ..., workers: _Optional[int] = ...) -> None: ...

class CheckpointStatus(_message.Message):
    __slots__ = ("directory", "ram_steps", "writing", "written_bytes", "total_bytes", "writing_s", "replicas", "uncommitted", "committing")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    WRITING_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITING_S_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    UNCOMMITTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTING_FIELD_NUMBER: _ClassVar[int]
    directory: str
    ram_steps: _containers.RepeatedScalarFieldContainer[int]
    writing: _containers.RepeatedScalarFieldContainer[int]
    written_bytes: int
    total_bytes: int
    writing_s: float
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaSteps]
    uncommitted: _containers.RepeatedScalarFieldContainer[int]
    committing: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, directory: _Optional[str] = ..., ram_steps: _Optional[_Iterable[int]] = ..., writing: _Optional[_Iterable[int]] = ..., written_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., writing_s: _Optional[float] = ..., replicas: _Optional[_Iterable[_Union[ReplicaSteps, _Mapping]]] = ..., uncommitted: _Optional[_Iterable[int]] = ..., committing: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaSteps(_message.Message):
    __slots__ = ("source_host", "steps", "nbytes")
    SOURCE_HOST_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    source_host: int
    steps: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, source_host: _Optional[int] = ..., steps: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("identity", "versions", "registry", "arena_size", "arena_used", "arena_blocks", "workers", "uptime_s", "calls", "feeds", "checkpoints", "tenants", "trainers", "tenant", "arena_kept")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARENA_USED_FIELD_NUMBER: _ClassVar[int]
    ARENA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ARENA_KEPT_FIELD_NUMBER: _ClassVar[int]
    identity: HostIdentity
    versions: Versions
    registry: _containers.RepeatedCompositeFieldContainer[RegistryEntry]
    arena_size: int
    arena_used: int
    arena_blocks: int
    workers: int
    uptime_s: float
    calls: int
    feeds: _containers.RepeatedCompositeFieldContainer[FeedStatus]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointStatus]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    trainers: _containers.RepeatedCompositeFieldContainer[TrainerStatus]
    tenant: str
    arena_kept: int
    def __init__(self, identity: _Optional[_Union[HostIdentity, _Mapping]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., registry: _Optional[_Iterable[_Union[RegistryEntry, _Mapping]]] = ..., arena_size: _Optional[int] = ..., arena_used: _Optional[int] = ..., arena_blocks: _Optional[int] = ..., workers: _Optional[int] = ..., uptime_s: _Optional[float] = ..., calls: _Optional[int] = ..., feeds: _Optional[_Iterable[_Union[FeedStatus, _Mapping]]] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointStatus, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ..., trainers: _Optional[_Iterable[_Union[TrainerStatus, _Mapping]]] = ..., tenant: _Optional[str] = ..., arena_kept: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("pid", "rank", "restart", "steps", "since_step_s", "slowest_step_s", "stall_timeout_s", "stalled", "ended", "pid_verified", "tenant", "phase", "cpu_s", "phase_s", "last_step_unix")
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    PID_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_UNIX_FIELD_NUMBER: _ClassVar[int]
    pid: int
    rank: int
    restart: int
    steps: int
    since_step_s: float
    slowest_step_s: float
    stall_timeout_s: float
    stalled: bool
    ended: bool
    pid_verified: bool
    tenant: str
    phase: str
    cpu_s: float
    phase_s: float
    last_step_unix: float
    def __init__(self, pid: _Optional[int] = ..., rank: _Optional[int] = ..., restart: _Optional[int] = ..., steps: _Optional[int] = ..., since_step_s: _Optional[float] = ..., slowest_step_s: _Optional[float] = ..., stall_timeout_s: _Optional[float] = ..., stalled: _Optional[bool] = ..., ended: _Optional[bool] = ..., pid_verified: _Optional[bool] = ..., tenant: _Optional[str] = ..., phase: _Optional[str] = ..., cpu_s: _Optional[float] = ..., phase_s: _Optional[float] = ..., last_step_unix: _Optional[float] = ...) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("name", "sessions", "workers", "arena_bytes", "arena_guaranteed", "arena_ceiling", "feeds", "feed_workers", "weight", "waiting", "batches", "saves", "ram_tier_bytes", "ram_tier_quota")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_GUARANTEED_FIELD_NUMBER: _ClassVar[int]
    ARENA_CEILING_FIELD_NUMBER: _ClassVar[int]
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    FEED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAVES_FIELD_NUMBER: _ClassVar[int]
    RAM_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_TIER_QUOTA_FIELD_NUMBER: _ClassVar[int]
    name: str
    sessions: int
    workers: int
    arena_bytes: int
    arena_guaranteed: int
    arena_ceiling: int
    feeds: int
    feed_workers: int
    weight: float
    waiting: int
    batches: int
    saves: int
    ram_tier_bytes: int
    ram_tier_quota: int
    def __init__(self, name: _Optional[str] = ..., sessions: _Optional[int] = ..., workers: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., arena_guaranteed: _Optional[int] = ..., arena_ceiling: _Optional[int] = ..., feeds: _Optional[int] = ..., feed_workers: _Optional[int] = ..., weight: _Optional[float] = ..., waiting: _Optional[int] = ..., batches: _Optional[int] = ..., saves: _Optional[int] = ..., ram_tier_bytes: _Optional[int] = ..., ram_tier_quota: _Optional[int] = ...) -> None: ...

class StalledRequest(_message.Message):
    __slots__ = ("rank", "restart", "since_step_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    restart: int
    since_step_s: float
    def __init__(self, rank: _Optional[int] = ..., restart: _Optional[int] = ..., since_step_s: _Optional[float] = ...) -> None: ...

class StalledResponse(_message.Message):
    __slots__ = ("marked",)
    MARKED_FIELD_NUMBER: _ClassVar[int]
    marked: int
    def __init__(self, marked: _Optional[int] = ...) -> None: ...
