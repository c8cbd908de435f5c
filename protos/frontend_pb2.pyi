from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToEngine(_message.Message):
    __slots__ = ("hello", "call", "cancel")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    call: Call
    cancel: Cancel
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., call: _Optional[_Union[Call, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class Call(_message.Message):
    __slots__ = ("call_id", "method", "request")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    method: str
    request: bytes
    def __init__(self, call_id: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("call_id",)
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    def __init__(self, call_id: _Optional[int] = ...) -> None: ...

class ToFrontend(_message.Message):
    __slots__ = ("replies", "state")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[Reply]
    state: State
    def __init__(self, replies: _Optional[_Iterable[_Union[Reply, _Mapping]]] = ..., state: _Optional[_Union[State, _Mapping]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("call_id", "messages", "done", "status_code", "details")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    messages: _containers.RepeatedScalarFieldContainer[bytes]
    done: bool
    status_code: int
    details: str
    def __init__(self, call_id: _Optional[int] = ..., messages: _Optional[_Iterable[bytes]] = ..., done: _Optional[bool] = ..., status_code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class State(_message.Message):
    __slots__ = ("serving",)
    SERVING_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    def __init__(self, serving: _Optional[bool] = ...) -> None: ...
