from fairfl.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateTensor(_message.Message):
    __slots__ = ("tensor", "numpy")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    NUMPY_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.Tensor
    numpy: bool
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., numpy: _Optional[bool] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("format_version", "run_id", "experiment_yaml", "round", "model", "state_json", "tensors", "events", "saved_unix", "finished", "final_state", "final_message", "task_id_key")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_YAML_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SAVED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINAL_STATE_FIELD_NUMBER: _ClassVar[int]
    FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_KEY_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    run_id: str
    experiment_yaml: str
    round: int
    model: _tensor_pb2.Tensor
    state_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[StateTensor]
    events: int
    saved_unix: float
    finished: bool
    final_state: str
    final_message: str
    task_id_key: bytes
    def __init__(self, format_version: _Optional[int] = ..., run_id: _Optional[str] = ..., experiment_yaml: _Optional[str] = ..., round: _Optional[int] = ..., model: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., state_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[StateTensor, _Mapping]]] = ..., events: _Optional[int] = ..., saved_unix: _Optional[float] = ..., finished: _Optional[bool] = ..., final_state: _Optional[str] = ..., final_message: _Optional[str] = ..., task_id_key: _Optional[bytes] = ...) -> None: ...

class PendingRound(_message.Message):
    __slots__ = ("run_id", "round", "selected", "population")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    POPULATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    selected: _containers.RepeatedScalarFieldContainer[int]
    population: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., selected: _Optional[_Iterable[int]] = ..., population: _Optional[int] = ...) -> None: ...
