from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_LOADING: _ClassVar[ReplicaState]
    REPLICA_STATE_READY: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]
    REPLICA_STATE_STOPPING: _ClassVar[ReplicaState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_REPLICA_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_ENGINE_FAILED: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_MODEL_FILE: _ClassVar[ErrorCode]
    ERROR_CODE_OVERLOADED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_SCHEMA: _ClassVar[ErrorCode]
    ERROR_CODE_DRAINING: _ClassVar[ErrorCode]
    ERROR_CODE_ENDPOINT_IN_USE: _ClassVar[ErrorCode]

class SplitMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLIT_MODE_NONE: _ClassVar[SplitMode]
    SPLIT_MODE_LAYER: _ClassVar[SplitMode]
    SPLIT_MODE_TENSOR: _ClassVar[SplitMode]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_LOADING: ReplicaState
REPLICA_STATE_READY: ReplicaState
REPLICA_STATE_FAILED: ReplicaState
REPLICA_STATE_STOPPING: ReplicaState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: ErrorCode
ERROR_CODE_REPLICA_NOT_FOUND: ErrorCode
ERROR_CODE_ENGINE_FAILED: ErrorCode
ERROR_CODE_BAD_MODEL_FILE: ErrorCode
ERROR_CODE_OVERLOADED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_INVALID_SCHEMA: ErrorCode
ERROR_CODE_DRAINING: ErrorCode
ERROR_CODE_ENDPOINT_IN_USE: ErrorCode
SPLIT_MODE_NONE: SplitMode
SPLIT_MODE_LAYER: SplitMode
SPLIT_MODE_TENSOR: SplitMode

class ModelFile(_message.Message):
    __slots__ = ("sha256", "size_bytes", "download_url")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_URL_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    download_url: str
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., download_url: _Optional[str] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("replica_id", "model_name", "sha256", "size_bytes", "download_url", "context_length", "parallel", "threads", "chat_template", "rpc_servers", "n_gpu_layers", "split_mode", "tensor_split", "batch_invariant", "files", "swa_window")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_URL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RPC_SERVERS_FIELD_NUMBER: _ClassVar[int]
    N_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_MODE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SPLIT_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SWA_WINDOW_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model_name: str
    sha256: str
    size_bytes: int
    download_url: str
    context_length: int
    parallel: int
    threads: int
    chat_template: str
    rpc_servers: _containers.RepeatedScalarFieldContainer[str]
    n_gpu_layers: int
    split_mode: SplitMode
    tensor_split: _containers.RepeatedScalarFieldContainer[float]
    batch_invariant: bool
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    swa_window: bool
    def __init__(self, replica_id: _Optional[str] = ..., model_name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., download_url: _Optional[str] = ..., context_length: _Optional[int] = ..., parallel: _Optional[int] = ..., threads: _Optional[int] = ..., chat_template: _Optional[str] = ..., rpc_servers: _Optional[_Iterable[str]] = ..., n_gpu_layers: _Optional[int] = ..., split_mode: _Optional[_Union[SplitMode, str]] = ..., tensor_split: _Optional[_Iterable[float]] = ..., batch_invariant: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ..., swa_window: _Optional[bool] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("state", "error", "memory_bytes", "load_seconds")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    state: ReplicaState
    error: str
    memory_bytes: int
    load_seconds: float
    def __init__(self, state: _Optional[_Union[ReplicaState, str]] = ..., error: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class FreeMemoryRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class FreeMemoryResponse(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: bool
    def __init__(self, freed: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "has_seed", "repeat_penalty", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    has_seed: bool
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., repeat_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class InferenceRequest(_message.Message):
    __slots__ = ("replica_id", "request_id", "messages", "prompt", "max_tokens", "sampling", "stop", "resume", "no_prompt_cache", "json_schema", "logprobs", "top_logprobs", "tools", "n")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    NO_PROMPT_CACHE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt: str
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    resume: Continuation
    no_prompt_cache: bool
    json_schema: str
    logprobs: bool
    top_logprobs: int
    tools: str
    n: int
    def __init__(self, replica_id: _Optional[str] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., resume: _Optional[_Union[Continuation, _Mapping]] = ..., no_prompt_cache: _Optional[bool] = ..., json_schema: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., tools: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("token_ids", "delivered_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    delivered_bytes: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., delivered_bytes: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token", "decode_seconds", "queue_seconds")
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token: float
    decode_seconds: float
    queue_seconds: float
    def __init__(self, time_to_first_token: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class InferenceResponse(_message.Message):
    __slots__ = ("text", "index", "finish_reason", "usage", "timings", "token_ids", "prompt_tokens", "logprobs", "choice")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    text: str
    index: int
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choice: int
    def __init__(self, text: _Optional[str] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choice: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "piece", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    piece: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., piece: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("piece", "logprob")
    PIECE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    piece: bytes
    logprob: float
    def __init__(self, piece: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("replica_id", "messages", "text")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    text: str
    def __init__(self, replica_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "context_length")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("replica_id", "input")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    input: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_id: _Optional[str] = ..., input: _Optional[_Iterable[str]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("data", "prompt_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class StartRpcServerRequest(_message.Message):
    __slots__ = ("port", "threads", "cache")
    PORT_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    port: int
    threads: int
    cache: bool
    def __init__(self, port: _Optional[int] = ..., threads: _Optional[int] = ..., cache: _Optional[bool] = ...) -> None: ...

class RpcServerStatus(_message.Message):
    __slots__ = ("endpoint", "running", "pid", "error")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    running: bool
    pid: int
    error: str
    def __init__(self, endpoint: _Optional[str] = ..., running: _Optional[bool] = ..., pid: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class StopRpcServerRequest(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class StopRpcServerResponse(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class CheckRpcServersRequest(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class RpcServerCheck(_message.Message):
    __slots__ = ("endpoint", "ok", "connect_ms", "free_bytes", "total_bytes", "error")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CONNECT_MS_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    ok: bool
    connect_ms: float
    free_bytes: int
    total_bytes: int
    error: str
    def __init__(self, endpoint: _Optional[str] = ..., ok: _Optional[bool] = ..., connect_ms: _Optional[float] = ..., free_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class CheckRpcServersResponse(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[RpcServerCheck]
    def __init__(self, servers: _Optional[_Iterable[_Union[RpcServerCheck, _Mapping]]] = ...) -> None: ...

class MeasureLinkRequest(_message.Message):
    __slots__ = ("target", "bytes")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    target: str
    bytes: int
    def __init__(self, target: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("target", "rtt_ms", "mbit_s", "error")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MBIT_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    target: str
    rtt_ms: float
    mbit_s: float
    error: str
    def __init__(self, target: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., mbit_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequestUsageRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestUsage(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "completion_tokens", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    finished: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class GetRequestUsageResponse(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[RequestUsage]
    def __init__(self, usage: _Optional[_Iterable[_Union[RequestUsage, _Mapping]]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "model_name", "state", "error", "memory_bytes", "in_flight", "pid", "context_length", "parallel", "threads")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model_name: str
    state: ReplicaState
    error: str
    memory_bytes: int
    in_flight: int
    pid: int
    context_length: int
    parallel: int
    threads: int
    def __init__(self, replica_id: _Optional[str] = ..., model_name: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., error: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., pid: _Optional[int] = ..., context_length: _Optional[int] = ..., parallel: _Optional[int] = ..., threads: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_name", "version", "memory_total_bytes", "memory_available_bytes", "cpu_cores", "accelerators", "replicas", "memory_in_use_bytes", "in_flight", "load_average", "rpc_servers", "disk_free_bytes", "boot_id", "features")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATORS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_AVERAGE_FIELD_NUMBER: _ClassVar[int]
    RPC_SERVERS_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    version: str
    memory_total_bytes: int
    memory_available_bytes: int
    cpu_cores: int
    accelerators: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    memory_in_use_bytes: int
    in_flight: int
    load_average: float
    rpc_servers: _containers.RepeatedCompositeFieldContainer[RpcServerStatus]
    disk_free_bytes: int
    boot_id: str
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_name: _Optional[str] = ..., version: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., cpu_cores: _Optional[int] = ..., accelerators: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., memory_in_use_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., load_average: _Optional[float] = ..., rpc_servers: _Optional[_Iterable[_Union[RpcServerStatus, _Mapping]]] = ..., disk_free_bytes: _Optional[int] = ..., boot_id: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class QuantizeRequest(_message.Message):
    __slots__ = ("job_id", "source_files", "target", "eval_text", "threads")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FILES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    EVAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    source_files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    target: str
    eval_text: str
    threads: int
    def __init__(self, job_id: _Optional[str] = ..., source_files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ..., target: _Optional[str] = ..., eval_text: _Optional[str] = ..., threads: _Optional[int] = ...) -> None: ...

class QuantizeProgress(_message.Message):
    __slots__ = ("phase", "done", "total", "chunk", "sha256", "size_bytes", "seconds", "source", "result")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    phase: str
    done: int
    total: int
    chunk: bytes
    sha256: str
    size_bytes: int
    seconds: float
    source: Evaluation
    result: Evaluation
    def __init__(self, phase: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., chunk: _Optional[bytes] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., source: _Optional[_Union[Evaluation, _Mapping]] = ..., result: _Optional[_Union[Evaluation, _Mapping]] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("tokens", "mean_nll", "decode_tokens_per_second")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_NLL_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    mean_nll: float
    decode_tokens_per_second: float
    def __init__(self, tokens: _Optional[int] = ..., mean_nll: _Optional[float] = ..., decode_tokens_per_second: _Optional[float] = ...) -> None: ...
