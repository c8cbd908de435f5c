from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkMessage(_message.Message):
    __slots__ = ("seq", "epoch", "hello", "configure", "ready", "step", "step_result", "heartbeat", "reject", "step_error", "goodbye")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CONFIGURE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    STEP_ERROR_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    hello: Hello
    configure: Configure
    ready: Ready
    step: Step
    step_result: StepResult
    heartbeat: Heartbeat
    reject: Reject
    step_error: StepError
    goodbye: Goodbye
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., configure: _Optional[_Union[Configure, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., step_result: _Optional[_Union[StepResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ..., step_error: _Optional[_Union[StepError, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "instance_id", "model_name", "model_fingerprint", "tp_size", "dtype", "device", "block_size", "vocab_size", "attention_backend")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    instance_id: str
    model_name: str
    model_fingerprint: str
    tp_size: int
    dtype: str
    device: str
    block_size: int
    vocab_size: int
    attention_backend: str
    def __init__(self, protocol_version: _Optional[int] = ..., instance_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., tp_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., attention_backend: _Optional[str] = ...) -> None: ...

class Configure(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_logprobs")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_logprobs: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_logprobs: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("num_kv_blocks", "block_size", "attention_backend")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    block_size: int
    attention_backend: str
    def __init__(self, num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., attention_backend: _Optional[str] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("reason", "another_is_attached")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ANOTHER_IS_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    reason: str
    another_is_attached: bool
    def __init__(self, reason: _Optional[str] = ..., another_is_attached: _Optional[bool] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    message: str
    def __init__(self, step_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "suppressed_token_ids", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    min_tokens: int
    suppressed_token_ids: bytes
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., suppressed_token_ids: _Optional[bytes] = ..., logprobs: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("slot", "request_id", "token_ids", "num_prompt_tokens", "sampling")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request_id: str
    token_ids: bytes
    num_prompt_tokens: int
    sampling: SamplingOptions
    def __init__(self, slot: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("step_id", "freed_slots", "new_requests", "slots", "num_computed_tokens", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "previous_step_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    freed_slots: bytes
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    slots: bytes
    num_computed_tokens: bytes
    num_scheduled_tokens: bytes
    num_new_blocks: bytes
    new_block_ids: bytes
    previous_step_id: int
    def __init__(self, step_id: _Optional[int] = ..., freed_slots: _Optional[bytes] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., slots: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ..., num_scheduled_tokens: _Optional[bytes] = ..., num_new_blocks: _Optional[bytes] = ..., new_block_ids: _Optional[bytes] = ..., previous_step_id: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("forward_ms", "sample_ms", "total_ms", "device_idle_ms", "device_ms")
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MS_FIELD_NUMBER: _ClassVar[int]
    forward_ms: float
    sample_ms: float
    total_ms: float
    device_idle_ms: float
    device_ms: float
    def __init__(self, forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., device_idle_ms: _Optional[float] = ..., device_ms: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "sampled_logprobs", "top_token_ids", "top_logprobs", "timings")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: bytes
    sampled_logprobs: bytes
    top_token_ids: bytes
    top_logprobs: bytes
    timings: Timings
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[bytes] = ..., sampled_logprobs: _Optional[bytes] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
