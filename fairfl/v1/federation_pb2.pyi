from fairfl.v1 import common_pb2 as _common_pb2
from fairfl.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_TRAIN: _ClassVar[Phase]
    PHASE_EVALUATE: _ClassVar[Phase]
    PHASE_PROBE: _ClassVar[Phase]

class Optimizer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_UNSPECIFIED: _ClassVar[Optimizer]
    OPTIMIZER_SGD: _ClassVar[Optimizer]
    OPTIMIZER_ADAM: _ClassVar[Optimizer]

class GradNormalizer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAD_NORMALIZER_EXPECTED: _ClassVar[GradNormalizer]
    GRAD_NORMALIZER_REALIZED: _ClassVar[GradNormalizer]
    GRAD_NORMALIZER_FIXED: _ClassVar[GradNormalizer]

class ActivationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_MODE_FINAL_EPOCH_MEAN: _ClassVar[ActivationMode]
    ACTIVATION_MODE_EVAL_PASS: _ClassVar[ActivationMode]
    ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN: _ClassVar[ActivationMode]

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_UPDATE: _ClassVar[PayloadKind]
    PAYLOAD_KIND_GRADIENT: _ClassVar[PayloadKind]
    PAYLOAD_KIND_FIRST_STEP_UPDATE: _ClassVar[PayloadKind]
PHASE_UNSPECIFIED: Phase
PHASE_TRAIN: Phase
PHASE_EVALUATE: Phase
PHASE_PROBE: Phase
OPTIMIZER_UNSPECIFIED: Optimizer
OPTIMIZER_SGD: Optimizer
OPTIMIZER_ADAM: Optimizer
GRAD_NORMALIZER_EXPECTED: GradNormalizer
GRAD_NORMALIZER_REALIZED: GradNormalizer
GRAD_NORMALIZER_FIXED: GradNormalizer
ACTIVATION_MODE_FINAL_EPOCH_MEAN: ActivationMode
ACTIVATION_MODE_EVAL_PASS: ActivationMode
ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN: ActivationMode
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_UPDATE: PayloadKind
PAYLOAD_KIND_GRADIENT: PayloadKind
PAYLOAD_KIND_FIRST_STEP_UPDATE: PayloadKind

class RegisterRequest(_message.Message):
    __slots__ = ("agent_name", "client_ids", "device", "version", "shared", "data_signature", "client_data")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    DATA_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_DATA_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    client_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    version: str
    shared: bool
    data_signature: DataSignature
    client_data: _containers.RepeatedCompositeFieldContainer[ClientData]
    def __init__(self, agent_name: _Optional[str] = ..., client_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., shared: _Optional[bool] = ..., data_signature: _Optional[_Union[DataSignature, _Mapping]] = ..., client_data: _Optional[_Iterable[_Union[ClientData, _Mapping]]] = ...) -> None: ...

class DataSignature(_message.Message):
    __slots__ = ("input_shape", "num_classes", "feature_names")
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    num_classes: int
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, input_shape: _Optional[_Iterable[int]] = ..., num_classes: _Optional[int] = ..., feature_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ClientData(_message.Message):
    __slots__ = ("client_id", "num_train", "num_test")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAIN_FIELD_NUMBER: _ClassVar[int]
    NUM_TEST_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    num_train: int
    num_test: int
    def __init__(self, client_id: _Optional[int] = ..., num_train: _Optional[int] = ..., num_test: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("agent_id", "heartbeat_interval_seconds", "poll_wait_seconds")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLL_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    heartbeat_interval_seconds: float
    poll_wait_seconds: float
    def __init__(self, agent_id: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., poll_wait_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    def __init__(self, agent_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("agent_id", "max_tasks", "wait_seconds", "inline_blob_bytes", "cached_sha256")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INLINE_BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_SHA256_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    max_tasks: int
    wait_seconds: float
    inline_blob_bytes: int
    cached_sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_id: _Optional[str] = ..., max_tasks: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., inline_blob_bytes: _Optional[int] = ..., cached_sha256: _Optional[_Iterable[str]] = ...) -> None: ...

class InlineBlob(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.BundleHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.BundleHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PollReply(_message.Message):
    __slots__ = ("tasks", "blobs")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    blobs: _containers.RepeatedCompositeFieldContainer[InlineBlob]
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., blobs: _Optional[_Iterable[_Union[InlineBlob, _Mapping]]] = ...) -> None: ...

class RunSpecRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run_id", "experiment_yaml")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_YAML_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    experiment_yaml: str
    def __init__(self, run_id: _Optional[str] = ..., experiment_yaml: _Optional[str] = ...) -> None: ...

class GradientAlignment(_message.Message):
    __slots__ = ("fair_gradient", "alpha")
    FAIR_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    fair_gradient: _tensor_pb2.BlobRef
    alpha: float
    def __init__(self, fair_gradient: _Optional[_Union[_tensor_pb2.BlobRef, _Mapping]] = ..., alpha: _Optional[float] = ...) -> None: ...

class FairStep(_message.Message):
    __slots__ = ("global_loss", "fair_lambda")
    GLOBAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    FAIR_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    global_loss: float
    fair_lambda: float
    def __init__(self, global_loss: _Optional[float] = ..., fair_lambda: _Optional[float] = ...) -> None: ...

class DpSgd(_message.Message):
    __slots__ = ("sample_rate", "noise_multiplier", "clip_norm", "fair_lambda", "loss_noise_multiplier", "loss_clip", "loss_clip_min", "grad_normalizer", "fixed_batch", "shared_loss_batch", "plaintext_telemetry")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    FAIR_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    LOSS_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    LOSS_CLIP_FIELD_NUMBER: _ClassVar[int]
    LOSS_CLIP_MIN_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORMALIZER_FIELD_NUMBER: _ClassVar[int]
    FIXED_BATCH_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOSS_BATCH_FIELD_NUMBER: _ClassVar[int]
    PLAINTEXT_TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    sample_rate: float
    noise_multiplier: float
    clip_norm: float
    fair_lambda: float
    loss_noise_multiplier: float
    loss_clip: float
    loss_clip_min: float
    grad_normalizer: GradNormalizer
    fixed_batch: int
    shared_loss_batch: bool
    plaintext_telemetry: bool
    def __init__(self, sample_rate: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., clip_norm: _Optional[float] = ..., fair_lambda: _Optional[float] = ..., loss_noise_multiplier: _Optional[float] = ..., loss_clip: _Optional[float] = ..., loss_clip_min: _Optional[float] = ..., grad_normalizer: _Optional[_Union[GradNormalizer, str]] = ..., fixed_batch: _Optional[int] = ..., shared_loss_batch: _Optional[bool] = ..., plaintext_telemetry: _Optional[bool] = ...) -> None: ...

class LocalTrainingConfig(_message.Message):
    __slots__ = ("local_steps", "local_epochs", "batch_size", "lr", "optimizer", "momentum", "weight_decay", "prox_mu", "alignment", "fair_step", "dp", "record_first_step", "want_bias_update", "want_activation", "loss_eval_batches", "activation_mode", "skip_losses", "procedures")
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    PROX_MU_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    FAIR_STEP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    WANT_BIAS_UPDATE_FIELD_NUMBER: _ClassVar[int]
    WANT_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LOSS_EVAL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_MODE_FIELD_NUMBER: _ClassVar[int]
    SKIP_LOSSES_FIELD_NUMBER: _ClassVar[int]
    PROCEDURES_FIELD_NUMBER: _ClassVar[int]
    local_steps: int
    local_epochs: int
    batch_size: int
    lr: float
    optimizer: Optimizer
    momentum: float
    weight_decay: float
    prox_mu: float
    alignment: GradientAlignment
    fair_step: FairStep
    dp: DpSgd
    record_first_step: bool
    want_bias_update: bool
    want_activation: bool
    loss_eval_batches: int
    activation_mode: ActivationMode
    skip_losses: bool
    procedures: _containers.RepeatedCompositeFieldContainer[ProcedureSpec]
    def __init__(self, local_steps: _Optional[int] = ..., local_epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., lr: _Optional[float] = ..., optimizer: _Optional[_Union[Optimizer, str]] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., prox_mu: _Optional[float] = ..., alignment: _Optional[_Union[GradientAlignment, _Mapping]] = ..., fair_step: _Optional[_Union[FairStep, _Mapping]] = ..., dp: _Optional[_Union[DpSgd, _Mapping]] = ..., record_first_step: _Optional[bool] = ..., want_bias_update: _Optional[bool] = ..., want_activation: _Optional[bool] = ..., loss_eval_batches: _Optional[int] = ..., activation_mode: _Optional[_Union[ActivationMode, str]] = ..., skip_losses: _Optional[bool] = ..., procedures: _Optional[_Iterable[_Union[ProcedureSpec, _Mapping]]] = ...) -> None: ...

class ProcedureSpec(_message.Message):
    __slots__ = ("ref", "params")
    REF_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ref: str
    params: _struct_pb2.Struct
    def __init__(self, ref: _Optional[str] = ..., params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ProbeConfig(_message.Message):
    __slots__ = ("want_gradient", "gradient_batches", "batch_size", "loss_eval_batches")
    WANT_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOSS_EVAL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    want_gradient: bool
    gradient_batches: int
    batch_size: int
    loss_eval_batches: int
    def __init__(self, want_gradient: _Optional[bool] = ..., gradient_batches: _Optional[int] = ..., batch_size: _Optional[int] = ..., loss_eval_batches: _Optional[int] = ...) -> None: ...

class EvaluateConfig(_message.Message):
    __slots__ = ("include_train_loss",)
    INCLUDE_TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    include_train_loss: bool
    def __init__(self, include_train_loss: _Optional[bool] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "run_id", "round", "phase", "client_id", "model", "seed", "deadline_unix", "train", "probe", "evaluate")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    run_id: str
    round: int
    phase: Phase
    client_id: int
    model: _tensor_pb2.BlobRef
    seed: int
    deadline_unix: float
    train: LocalTrainingConfig
    probe: ProbeConfig
    evaluate: EvaluateConfig
    def __init__(self, task_id: _Optional[str] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., client_id: _Optional[int] = ..., model: _Optional[_Union[_tensor_pb2.BlobRef, _Mapping]] = ..., seed: _Optional[int] = ..., deadline_unix: _Optional[float] = ..., train: _Optional[_Union[LocalTrainingConfig, _Mapping]] = ..., probe: _Optional[_Union[ProbeConfig, _Mapping]] = ..., evaluate: _Optional[_Union[EvaluateConfig, _Mapping]] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("kind", "tensors")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    kind: PayloadKind
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    def __init__(self, kind: _Optional[_Union[PayloadKind, str]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ...) -> None: ...

class ResultHeader(_message.Message):
    __slots__ = ("task_id", "run_id", "round", "client_id", "phase", "agent_id", "num_samples", "loss_before", "loss_after", "test_accuracy", "test_loss", "metrics", "bias_update", "activation", "payloads", "total_bytes", "sha256", "noisy_loss", "sha256_in_trailer")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LOSS_AFTER_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    BIAS_UPDATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NOISY_LOSS_FIELD_NUMBER: _ClassVar[int]
    SHA256_IN_TRAILER_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    run_id: str
    round: int
    client_id: int
    phase: Phase
    agent_id: str
    num_samples: int
    loss_before: float
    loss_after: float
    test_accuracy: float
    test_loss: float
    metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.Metric]
    bias_update: _tensor_pb2.Tensor
    activation: _tensor_pb2.Tensor
    payloads: _containers.RepeatedCompositeFieldContainer[Payload]
    total_bytes: int
    sha256: str
    noisy_loss: float
    sha256_in_trailer: bool
    def __init__(self, task_id: _Optional[str] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., client_id: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., agent_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., loss_before: _Optional[float] = ..., loss_after: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., metrics: _Optional[_Iterable[_Union[_common_pb2.Metric, _Mapping]]] = ..., bias_update: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., activation: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., payloads: _Optional[_Iterable[_Union[Payload, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., noisy_loss: _Optional[float] = ..., sha256_in_trailer: _Optional[bool] = ...) -> None: ...

class ResultTrailer(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: ResultHeader
    data: bytes
    trailer: ResultTrailer
    def __init__(self, header: _Optional[_Union[ResultHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[ResultTrailer, _Mapping]] = ...) -> None: ...

class ResultUpload(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ResultHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ResultHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ResultHeader]
    def __init__(self, results: _Optional[_Iterable[_Union[ResultHeader, _Mapping]]] = ...) -> None: ...

class ResultStatus(_message.Message):
    __slots__ = ("task_id", "code", "message")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    code: int
    message: str
    def __init__(self, task_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ResultBatchReply(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedCompositeFieldContainer[ResultStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[ResultStatus, _Mapping]]] = ...) -> None: ...
