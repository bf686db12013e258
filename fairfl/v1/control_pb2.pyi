from fairfl.v1 import common_pb2 as _common_pb2
from fairfl.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_PENDING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_COMPLETED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_PENDING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_COMPLETED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_FAILED: RunState

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsReply(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("experiment_yaml", "run_id")
    EXPERIMENT_YAML_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    experiment_yaml: str
    run_id: str
    def __init__(self, experiment_yaml: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "state", "round", "total_rounds", "message", "registered_clients", "name", "strategy", "started_unix", "ended_unix", "model_sha256", "experiment_yaml")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_YAML_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    round: int
    total_rounds: int
    message: str
    registered_clients: int
    name: str
    strategy: str
    started_unix: float
    ended_unix: float
    model_sha256: str
    experiment_yaml: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., round: _Optional[int] = ..., total_rounds: _Optional[int] = ..., message: _Optional[str] = ..., registered_clients: _Optional[int] = ..., name: _Optional[str] = ..., strategy: _Optional[str] = ..., started_unix: _Optional[float] = ..., ended_unix: _Optional[float] = ..., model_sha256: _Optional[str] = ..., experiment_yaml: _Optional[str] = ...) -> None: ...

class FairnessReport(_message.Message):
    __slots__ = ("mean", "variance", "std", "worst_5", "worst_10", "best_5", "best_10", "jain_index", "cv", "weighted_accuracy", "mean_loss", "loss_variance", "evaluated_clients", "missing_clients")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    WORST_5_FIELD_NUMBER: _ClassVar[int]
    WORST_10_FIELD_NUMBER: _ClassVar[int]
    BEST_5_FIELD_NUMBER: _ClassVar[int]
    BEST_10_FIELD_NUMBER: _ClassVar[int]
    JAIN_INDEX_FIELD_NUMBER: _ClassVar[int]
    CV_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    MISSING_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    mean: float
    variance: float
    std: float
    worst_5: float
    worst_10: float
    best_5: float
    best_10: float
    jain_index: float
    cv: float
    weighted_accuracy: float
    mean_loss: float
    loss_variance: float
    evaluated_clients: int
    missing_clients: int
    def __init__(self, mean: _Optional[float] = ..., variance: _Optional[float] = ..., std: _Optional[float] = ..., worst_5: _Optional[float] = ..., worst_10: _Optional[float] = ..., best_5: _Optional[float] = ..., best_10: _Optional[float] = ..., jain_index: _Optional[float] = ..., cv: _Optional[float] = ..., weighted_accuracy: _Optional[float] = ..., mean_loss: _Optional[float] = ..., loss_variance: _Optional[float] = ..., evaluated_clients: _Optional[int] = ..., missing_clients: _Optional[int] = ...) -> None: ...

class ClientEvaluation(_message.Message):
    __slots__ = ("client_id", "accuracy", "loss", "num_samples")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    accuracy: float
    loss: float
    num_samples: int
    def __init__(self, client_id: _Optional[int] = ..., accuracy: _Optional[float] = ..., loss: _Optional[float] = ..., num_samples: _Optional[int] = ...) -> None: ...

class RoundEvent(_message.Message):
    __slots__ = ("round", "selected", "results_accepted", "results_rejected", "results_late", "duration_seconds", "mean_train_loss", "aggregation_weights", "evaluated", "fairness", "clients", "model_sha256", "epsilon_spent", "strategy_metrics", "clusters", "selection_seconds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_LATE_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_METRICS_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    SELECTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    selected: _containers.RepeatedScalarFieldContainer[int]
    results_accepted: int
    results_rejected: int
    results_late: int
    duration_seconds: float
    mean_train_loss: float
    aggregation_weights: _containers.RepeatedScalarFieldContainer[float]
    evaluated: bool
    fairness: FairnessReport
    clients: _containers.RepeatedCompositeFieldContainer[ClientEvaluation]
    model_sha256: str
    epsilon_spent: float
    strategy_metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.Metric]
    clusters: _containers.RepeatedCompositeFieldContainer[ClientCluster]
    selection_seconds: float
    def __init__(self, round: _Optional[int] = ..., selected: _Optional[_Iterable[int]] = ..., results_accepted: _Optional[int] = ..., results_rejected: _Optional[int] = ..., results_late: _Optional[int] = ..., duration_seconds: _Optional[float] = ..., mean_train_loss: _Optional[float] = ..., aggregation_weights: _Optional[_Iterable[float]] = ..., evaluated: _Optional[bool] = ..., fairness: _Optional[_Union[FairnessReport, _Mapping]] = ..., clients: _Optional[_Iterable[_Union[ClientEvaluation, _Mapping]]] = ..., model_sha256: _Optional[str] = ..., epsilon_spent: _Optional[float] = ..., strategy_metrics: _Optional[_Iterable[_Union[_common_pb2.Metric, _Mapping]]] = ..., clusters: _Optional[_Iterable[_Union[ClientCluster, _Mapping]]] = ..., selection_seconds: _Optional[float] = ...) -> None: ...

class ClientCluster(_message.Message):
    __slots__ = ("client_id", "cluster", "true_group")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    TRUE_GROUP_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    cluster: int
    true_group: int
    def __init__(self, client_id: _Optional[int] = ..., cluster: _Optional[int] = ..., true_group: _Optional[int] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run_id", "status", "round")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    status: RunStatus
    round: RoundEvent
    def __init__(self, run_id: _Optional[str] = ..., status: _Optional[_Union[RunStatus, _Mapping]] = ..., round: _Optional[_Union[RoundEvent, _Mapping]] = ...) -> None: ...
