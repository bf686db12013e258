"""The client-side local-procedure hook: a composable piece of a client's local-training loop (public API).

A client's TRAIN task runs one loop (client_agent/trainer.py): for each step, draw a batch, forward, loss, backward,
optimiser step. Every algorithm that changes what happens on the client is a `LocalProcedure` plugged into that
loop: FairFL's own pieces (FedProx's proximal term, FedEBA+'s gradient alignment, FedFair's per-step lr,
Equitable-FL's activation capture, HiCS-FL's bias capture, FedEBA+'s first-step record, FedFDP's DP-SGD) and any
user's. A strategy puts a user procedure on a task with `attach_procedure(train_config, MyProcedure, params)`; the
task then carries `ProcedureSpec{ref, params}` (the procedure's registered name or `package.module:attr`, and its
declared parameters as a Struct), so a new client-side algorithm needs no proto change. The agent resolves the
reference through `PROCEDURES` (this process's registrations, then entry points of group `fairfl.procedures`, then
the import path), builds one instance per task from the parsed parameters and calls its hooks in the order of the
loop:

    begin(state)                          once, before the first step (optimizer and model at x_t ready)
    per step:
        wants_features(state) -> bool     True: the forward goes through the model head, state.features is set
        after_forward(state)              state.logits / state.features of this batch are known
        objective(state, loss) -> loss    add terms to the loss that is differentiated (chained in order)
        after_backward(state)             gradients are in p.grad: rewrite them (e.g. align, scale)
        step_lr(state, loss) -> lr|None   a step size for this step (persists until changed)
        after_step(state)                 the optimiser has stepped
    finish(state, result)                 once, after training: add metrics or signatures to the ClientResult

Hooks run in task order: FairFL's built-in pieces first (in the order above), then `procedures` as listed. A
procedure's parameters are a dataclass `Params` whose fields all have defaults; they are checked with the
config's validation (unknown keys, types, the dataclass's own `validate(path)`) on the aggregator when attached and
again on the agent when the task arrives.

Procedures run on the non-private path only: a DP-SGD task refuses them. Its one piece (client_agent.pieces.DpSgd)
draws the Poisson batches and writes the clipped, noised gradient itself, through hooks internal to FairFL's
built-in pieces (client_agent.pieces.LoopOwner), not part of this API.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from fairfl.models import Head, HeadError, model_head
from fairfl.plugins import (
    NoParams,
    PluginError,
    Registry,
    coerce_params,
    params_from_struct,
    params_to_struct,
    reference_of,
)
from fairfl.protocol import ClientResult
from fairfl.v1 import federation_pb2

__all__ = [
    "PROCEDURES",
    "LocalProcedure",
    "LocalState",
    "NoParams",
    "Optimizer",
    "attach_procedure",
    "register_procedure",
    "resolve_procedures",
]


class Optimizer(Protocol):
    """The optimiser a procedure sees (`LocalState.optimizer`): torch.optim's surface. A torch.optim.Optimizer (an
    Adam task's) or the loop's own SGD (client_agent.trainer.PlainSgd, torch.optim.SGD's update bit for bit). A
    procedure may set `group["lr"]` in param_groups between steps (step_lr is the usual way)."""

    param_groups: list[dict[str, Any]]

    def step(self) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


@dataclass
class LocalState:
    """What a procedure sees of one local training. The loop owns it; procedures read it and may change the
    model's gradients (after_backward) or keep their own state on `self`."""

    config: federation_pb2.LocalTrainingConfig
    model: nn.Module
    params: list[torch.Tensor]  # model.parameters(), in layout order
    optimizer: Optimizer  # torch.optim's surface: param_groups, step(), zero_grad()
    x0: torch.Tensor  # the global model x_t, flat, on the device
    # The client's local training data, on the device. For a site's on-disk data (large .npy features, see
    # fairfl.data.lazy) this is a row reader: `x_train[idx]` reads those rows onto the device, and whole-tensor
    # operations are not available; index it with batches of row ids.
    x_train: torch.Tensor
    y_train: torch.Tensor
    device: torch.device
    steps: int  # local steps this task runs
    batch_size: int
    base_lr: float  # the task's lr
    lr: float  # the step size in effect (step_lr may change it)
    seed: int  # the task's seed
    step: int = -1  # the current step, 0-based (-1 before the first)
    inputs: torch.Tensor | None = None  # this step's batch
    targets: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    features: torch.Tensor | None = None  # penultimate activations, when some procedure wants_features
    loss: torch.Tensor | None = None  # this step's cross-entropy (before objective terms)
    update: torch.Tensor | None = None  # x_K − x_t, flat, on the device: set before finish
    extras: dict[str, Any] = field(default_factory=dict)  # free room for procedures that cooperate
    _head: Head | None = field(default=None, init=False, repr=False)

    @property
    def head(self) -> Head:
        """The model's output layer and penultimate features (fairfl.models.model_head), found once per task."""
        if self._head is None:
            self._head = model_head(self.model, "a local procedure's penultimate features")
        return self._head

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits) of the batch `x` from one forward pass. A declared head runs
        classifier(features(x)), which is its model(x); a head found by convention runs model(x) and keeps what
        its output layer receives."""
        head = self.head
        if head.declared:
            features = head.features(x)
            return features, head.classifier(features)
        seen: list[torch.Tensor] = []
        handle = head.classifier.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
        try:
            logits = self.model(x)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise HeadError(
                f"model.name: {type(self.model).__name__}'s output layer ran {len(seen)} times in one forward pass; "
                "a local procedure's penultimate features need it to run once (declare features(x) and classifier)"
            )
        return seen[0], logits


class LocalProcedure:
    """A piece of the local-training loop. Subclass it, declare `Params` (a dataclass, all fields defaulted) and
    override the hooks you need; every default does nothing. One instance is built per task: `self.params` holds
    the parsed parameters, and the instance may keep per-task state on itself."""

    Params: ClassVar[type] = NoParams

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()

    def begin(self, state: LocalState) -> None:
        """Once, before the first step."""

    def wants_features(self, state: LocalState) -> bool:
        """True when this step's forward must expose the penultimate activations in `state.features`."""
        return False

    def after_forward(self, state: LocalState) -> None:
        """After this step's forward: `state.logits` (and `state.features` if wanted) are set."""

    def objective(self, state: LocalState, loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate, given the one so far (the batch's cross-entropy plus earlier terms)."""
        return loss

    def after_backward(self, state: LocalState) -> None:
        """The gradients are in each parameter's `.grad`; rewrite them in place if the algorithm says so."""

    def step_lr(self, state: LocalState, loss: torch.Tensor) -> float | None:
        """A step size for this step (kept for later steps until changed), or None to leave it."""
        return None

    def after_step(self, state: LocalState) -> None:
        """After the optimiser step."""

    def finish(self, state: LocalState, result: ClientResult) -> None:
        """Once, after training (`state.update` is set): add metrics or signatures to `result`."""


def _check(obj: Any) -> str | None:
    if not isinstance(obj, type) or not issubclass(obj, LocalProcedure):
        return f"expected a subclass of fairfl.procedure.LocalProcedure, got {obj!r}"
    if not dataclasses.is_dataclass(obj.Params):
        return f"its Params {obj.Params!r} is not a dataclass"
    return None


PROCEDURES: Registry[type[LocalProcedure]] = Registry("local procedure", "fairfl.procedures", _check)


def register_procedure(name: str, procedure: type[LocalProcedure]) -> type[LocalProcedure]:
    """Make `procedure` known as `name` in this process (a `module:attr` reference works in every process)."""
    return PROCEDURES.register(name, procedure)


def _reference(cls: type[LocalProcedure], field: str) -> str:
    """How a task names `cls`: its `module:qualname`, importable in every process (an agent is often another
    process); a class only this process can name (defined in a function, or in __main__) by its registered name."""
    try:
        return reference_of(cls)
    except PluginError:
        try:
            return PROCEDURES.name_of(cls)  # a registered name, else reference_of's error again
        except PluginError as err:
            raise PluginError(f"{field}: {err}") from None


def attach_procedure(
    cfg: federation_pb2.LocalTrainingConfig,
    procedure: type[LocalProcedure] | str,
    params: Any = None,
    field: str = "strategy.client_procedure",
) -> None:
    """Put `procedure` (a class or a name / `package.module:attr`) with `params` (its Params, a mapping or None)
    on a TRAIN task's config, after the checks the agent will make; PluginError naming `field` otherwise."""
    if isinstance(procedure, str):
        cls = PROCEDURES.load(procedure, field)
        ref = procedure
    else:
        reason = _check(procedure)
        if reason is not None:
            raise PluginError(f"{field}: {procedure!r} is not a local procedure: {reason}")
        cls, ref = procedure, _reference(procedure, field)
    checked = coerce_params(cls.Params, params, f"{field}.params")
    spec = cfg.procedures.add(ref=ref)
    spec.params.CopyFrom(params_to_struct(checked, f"{field}.params"))


def resolve_procedures(
    cfg: federation_pb2.LocalTrainingConfig, field: str = "train.procedures"
) -> list[LocalProcedure]:
    """One instance of each procedure the task names, in order; PluginError naming `field[i]` when one cannot be
    imported, is not a LocalProcedure, or its parameters are refused."""
    out = []
    for i, spec in enumerate(cfg.procedures):
        path = f"{field}[{i}]"
        cls = PROCEDURES.load(spec.ref, f"{path}.ref")
        out.append(cls(params_from_struct(cls.Params, spec.params, f"{path}.params")))
    return out
