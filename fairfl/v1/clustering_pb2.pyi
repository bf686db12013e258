from google.protobuf import struct_pb2 as _struct_pb2
from fairfl.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLUSTER_METHOD_UNSPECIFIED: _ClassVar[ClusterMethod]
    CLUSTER_METHOD_SPECTRAL: _ClassVar[ClusterMethod]
    CLUSTER_METHOD_HIERARCHICAL: _ClassVar[ClusterMethod]
CLUSTER_METHOD_UNSPECIFIED: ClusterMethod
CLUSTER_METHOD_SPECTRAL: ClusterMethod
CLUSTER_METHOD_HIERARCHICAL: ClusterMethod

class ClientSignature(_message.Message):
    __slots__ = ("client_id", "round", "num_samples", "bias_update", "activation", "loss")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BIAS_UPDATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    round: int
    num_samples: int
    bias_update: _tensor_pb2.Tensor
    activation: _tensor_pb2.Tensor
    loss: float
    def __init__(self, client_id: _Optional[int] = ..., round: _Optional[int] = ..., num_samples: _Optional[int] = ..., bias_update: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., activation: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., loss: _Optional[float] = ...) -> None: ...

class ReportSignaturesRequest(_message.Message):
    __slots__ = ("run_id", "signatures")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    signatures: _containers.RepeatedCompositeFieldContainer[ClientSignature]
    def __init__(self, run_id: _Optional[str] = ..., signatures: _Optional[_Iterable[_Union[ClientSignature, _Mapping]]] = ...) -> None: ...

class ReportSignaturesReply(_message.Message):
    __slots__ = ("stored", "instance_id")
    STORED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    stored: int
    instance_id: str
    def __init__(self, stored: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class SelectRequest(_message.Message):
    __slots__ = ("run_id", "round", "num_to_select", "candidates", "seed", "candidate_losses", "similarity", "candidate_num_samples", "sampler", "sampler_params")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_TO_SELECT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOSSES_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    num_to_select: int
    candidates: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    candidate_losses: _containers.RepeatedScalarFieldContainer[float]
    similarity: _tensor_pb2.Tensor
    candidate_num_samples: _containers.RepeatedScalarFieldContainer[int]
    sampler: str
    sampler_params: _struct_pb2.Struct
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., num_to_select: _Optional[int] = ..., candidates: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., candidate_losses: _Optional[_Iterable[float]] = ..., similarity: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., candidate_num_samples: _Optional[_Iterable[int]] = ..., sampler: _Optional[str] = ..., sampler_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class SelectReply(_message.Message):
    __slots__ = ("selected", "cluster_of_selected", "selection_seconds", "needs_losses", "instance_id")
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_OF_SELECTED_FIELD_NUMBER: _ClassVar[int]
    SELECTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_LOSSES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    selected: _containers.RepeatedScalarFieldContainer[int]
    cluster_of_selected: _containers.RepeatedScalarFieldContainer[int]
    selection_seconds: float
    needs_losses: bool
    instance_id: str
    def __init__(self, selected: _Optional[_Iterable[int]] = ..., cluster_of_selected: _Optional[_Iterable[int]] = ..., selection_seconds: _Optional[float] = ..., needs_losses: _Optional[bool] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ClusterRequest(_message.Message):
    __slots__ = ("run_id", "round", "method", "num_clusters", "client_ids", "rows", "similarity", "seed", "linkage", "true_groups")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LINKAGE_FIELD_NUMBER: _ClassVar[int]
    TRUE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    method: ClusterMethod
    num_clusters: int
    client_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: _tensor_pb2.Tensor
    similarity: _tensor_pb2.Tensor
    seed: int
    linkage: str
    true_groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., method: _Optional[_Union[ClusterMethod, str]] = ..., num_clusters: _Optional[int] = ..., client_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., similarity: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., seed: _Optional[int] = ..., linkage: _Optional[str] = ..., true_groups: _Optional[_Iterable[int]] = ...) -> None: ...

class ClusterReply(_message.Message):
    __slots__ = ("labels", "sizes", "equal_cluster_weights", "nmi")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    EQUAL_CLUSTER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NMI_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    equal_cluster_weights: _containers.RepeatedScalarFieldContainer[float]
    nmi: float
    def __init__(self, labels: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., equal_cluster_weights: _Optional[_Iterable[float]] = ..., nmi: _Optional[float] = ...) -> None: ...

class ForgetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ForgetRunReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
