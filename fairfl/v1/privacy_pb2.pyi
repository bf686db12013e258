from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Accountant(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCOUNTANT_UNSPECIFIED: _ClassVar[Accountant]
    ACCOUNTANT_RDP: _ClassVar[Accountant]
    ACCOUNTANT_PLD: _ClassVar[Accountant]

class PrincipalKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRINCIPAL_KIND_UNSPECIFIED: _ClassVar[PrincipalKind]
    PRINCIPAL_KIND_CLIENT: _ClassVar[PrincipalKind]
    PRINCIPAL_KIND_FEDERATION: _ClassVar[PrincipalKind]
    PRINCIPAL_KIND_NONE: _ClassVar[PrincipalKind]

class Mechanism(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MECHANISM_UNSPECIFIED: _ClassVar[Mechanism]
    MECHANISM_GRADIENT: _ClassVar[Mechanism]
    MECHANISM_LOSS: _ClassVar[Mechanism]
    MECHANISM_JOINT: _ClassVar[Mechanism]
    MECHANISM_MODEL: _ClassVar[Mechanism]
ACCOUNTANT_UNSPECIFIED: Accountant
ACCOUNTANT_RDP: Accountant
ACCOUNTANT_PLD: Accountant
PRINCIPAL_KIND_UNSPECIFIED: PrincipalKind
PRINCIPAL_KIND_CLIENT: PrincipalKind
PRINCIPAL_KIND_FEDERATION: PrincipalKind
PRINCIPAL_KIND_NONE: PrincipalKind
MECHANISM_UNSPECIFIED: Mechanism
MECHANISM_GRADIENT: Mechanism
MECHANISM_LOSS: Mechanism
MECHANISM_JOINT: Mechanism
MECHANISM_MODEL: Mechanism

class RegisterBudgetRequest(_message.Message):
    __slots__ = ("run_id", "epsilon", "delta", "accountant", "principal_kind", "orders")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_KIND_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epsilon: float
    delta: float
    accountant: Accountant
    principal_kind: PrincipalKind
    orders: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, run_id: _Optional[str] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., accountant: _Optional[_Union[Accountant, str]] = ..., principal_kind: _Optional[_Union[PrincipalKind, str]] = ..., orders: _Optional[_Iterable[float]] = ...) -> None: ...

class BudgetStatus(_message.Message):
    __slots__ = ("run_id", "epsilon", "delta", "accountant", "principal_kind")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_KIND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epsilon: float
    delta: float
    accountant: Accountant
    principal_kind: PrincipalKind
    def __init__(self, run_id: _Optional[str] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., accountant: _Optional[_Union[Accountant, str]] = ..., principal_kind: _Optional[_Union[PrincipalKind, str]] = ...) -> None: ...

class PrivacyEvent(_message.Message):
    __slots__ = ("principal", "mechanism", "sample_rate", "noise_multiplier", "count")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    principal: str
    mechanism: Mechanism
    sample_rate: float
    noise_multiplier: float
    count: int
    def __init__(self, principal: _Optional[str] = ..., mechanism: _Optional[_Union[Mechanism, str]] = ..., sample_rate: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class AuthorizeRoundRequest(_message.Message):
    __slots__ = ("run_id", "round", "events")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    events: _containers.RepeatedCompositeFieldContainer[PrivacyEvent]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., events: _Optional[_Iterable[_Union[PrivacyEvent, _Mapping]]] = ...) -> None: ...

class AuthorizeRoundReply(_message.Message):
    __slots__ = ("granted", "replayed", "max_epsilon")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    MAX_EPSILON_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    replayed: bool
    max_epsilon: float
    def __init__(self, granted: _Optional[bool] = ..., replayed: _Optional[bool] = ..., max_epsilon: _Optional[float] = ...) -> None: ...

class GetSpendRequest(_message.Message):
    __slots__ = ("run_id", "principal")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    principal: str
    def __init__(self, run_id: _Optional[str] = ..., principal: _Optional[str] = ...) -> None: ...

class PrincipalSpend(_message.Message):
    __slots__ = ("principal", "epsilon", "optimal_order", "events")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    OPTIMAL_ORDER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    principal: str
    epsilon: float
    optimal_order: float
    events: int
    def __init__(self, principal: _Optional[str] = ..., epsilon: _Optional[float] = ..., optimal_order: _Optional[float] = ..., events: _Optional[int] = ...) -> None: ...

class GetSpendReply(_message.Message):
    __slots__ = ("run_id", "delta", "target_epsilon", "spends", "max_epsilon", "rounds_recorded")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    SPENDS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPSILON_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_RECORDED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    delta: float
    target_epsilon: float
    spends: _containers.RepeatedCompositeFieldContainer[PrincipalSpend]
    max_epsilon: float
    rounds_recorded: int
    def __init__(self, run_id: _Optional[str] = ..., delta: _Optional[float] = ..., target_epsilon: _Optional[float] = ..., spends: _Optional[_Iterable[_Union[PrincipalSpend, _Mapping]]] = ..., max_epsilon: _Optional[float] = ..., rounds_recorded: _Optional[int] = ...) -> None: ...

class RemainingRoundsRequest(_message.Message):
    __slots__ = ("run_id", "principal", "per_round")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    principal: str
    per_round: _containers.RepeatedCompositeFieldContainer[PrivacyEvent]
    def __init__(self, run_id: _Optional[str] = ..., principal: _Optional[str] = ..., per_round: _Optional[_Iterable[_Union[PrivacyEvent, _Mapping]]] = ...) -> None: ...

class RemainingRoundsReply(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    def __init__(self, rounds: _Optional[int] = ...) -> None: ...

class CalibrateNoiseRequest(_message.Message):
    __slots__ = ("target_epsilon", "delta", "sample_rate", "steps", "accountant")
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    accountant: Accountant
    def __init__(self, target_epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., sample_rate: _Optional[float] = ..., steps: _Optional[int] = ..., accountant: _Optional[_Union[Accountant, str]] = ...) -> None: ...

class CalibrateNoiseReply(_message.Message):
    __slots__ = ("noise_multiplier", "epsilon")
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    noise_multiplier: float
    epsilon: float
    def __init__(self, noise_multiplier: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...
