"""Client selection as the round engine drives it, for any sampler (fairfl.sampling), from what it declares.

`SelectionContext` is what the engine asks a `Selector` for one round: the clustering service over gRPC
(aggregator_service.peers.RemoteSelector) or the same samplers in-process (fairfl.compose.local_selection, injected by
the composition layer); both turn it into the same `SelectionInput`, so they select identically.
`SelectionDriver` holds what the sampler needs from the engine across rounds:
- `client_signatures` {"bias_update"} (HiCS-FL): trained clients return their output-bias update
  (`want_bias_update`), reported to the selector as signatures after each round.
- `needs_losses` (power-of-choice): the sampler first names the candidates whose losses it needs; the engine probes
  them at the global model (a PROBE task, loss only) and asks again with the losses.
- `needs_similarity` (Clustered Sampling, DivFL): the last update of every client stays here (exact, or as a count
  sketch), and only the candidates' Gram matrix goes to the selector, never the models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from numpy.typing import NDArray

from fairfl import codec
from fairfl.config import ExperimentConfig
from fairfl.plugins import params_to_struct
from fairfl.protocol import UPDATE, ClientResult
from fairfl.rpc import CHUNK_BYTES
from fairfl.sampling import SelectionInput, SelectionOutput
from fairfl.v1 import clustering_pb2

# Below gRPC's default 4 MiB message limit with room for the rest of the request.
MAX_SIMILARITY_BYTES = 2 * CHUNK_BYTES - 64 * 1024


@dataclass(frozen=True)
class SelectionContext:
    """One selection request of the engine. Aligned lists follow `candidates`."""

    run_id: str
    round: int
    candidates: list[int]
    count: int
    seed: int
    params: Any = None  # the sampler's Params instance (None: its defaults)
    num_samples: list[int] | None = None  # training samples per candidate, 0 = not known yet
    losses: list[float] | None = None  # power-of-choice's second call: F_k(θ_t) of the candidates
    similarity: NDArray[np.float64] | None = None  # [n, n] Gram matrix of the candidates' last updates


class Selector(Protocol):
    def select(self, context: SelectionContext) -> SelectionOutput: ...

    def report_signatures(self, run_id: str, signatures: Sequence[clustering_pb2.ClientSignature]) -> None: ...


def selection_input(context: SelectionContext) -> SelectionInput:
    """The transport-free request (validated by its constructor, like the service's)."""
    return SelectionInput(
        run_id=context.run_id,
        round=context.round,
        num_to_select=context.count,
        candidates=np.asarray(context.candidates, dtype=np.int64),
        seed=context.seed,
        params=context.params,
        candidate_losses=None if context.losses is None else np.asarray(context.losses, dtype=np.float64),
        candidate_num_samples=None if context.num_samples is None else np.asarray(context.num_samples),
        similarity=context.similarity,
    )


def select_request(sampler: str, context: SelectionContext) -> clustering_pb2.SelectRequest:
    """The same request on the wire (float64 throughout, so the service sees exactly what the in-process path sees);
    `sampler` is the name or module:attr the service resolves, its parameters travel as a Struct."""
    request = clustering_pb2.SelectRequest(
        run_id=context.run_id,
        round=context.round,
        num_to_select=context.count,
        candidates=context.candidates,
        sampler=sampler,
        sampler_params=params_to_struct(context.params, "selection.params"),
        seed=context.seed,
        candidate_losses=context.losses or [],
        candidate_num_samples=context.num_samples or [],
    )
    if context.similarity is not None:
        if context.similarity.nbytes > MAX_SIMILARITY_BYTES:
            n = context.similarity.shape[0]
            raise ValueError(
                f"the {n}x{n} update similarity of round {context.round} ({context.similarity.nbytes} bytes) does not "
                f"fit one Select message; with clustered or divfl over gRPC keep data.num_clients <= "
                f"{math.isqrt(MAX_SIMILARITY_BYTES // 8)}, or run the clustering in-process"
            )
        request.similarity.CopyFrom(codec.tensor_to_proto("similarity", context.similarity))
    return request


def signature_proto(result: ClientResult) -> clustering_pb2.ClientSignature:
    """A trained client's HiCS-FL signature as the selectors take it (float64 bias update)."""
    assert result.bias_update is not None
    return clustering_pb2.ClientSignature(
        client_id=result.client_id,
        round=result.round,
        num_samples=result.num_samples,
        bias_update=codec.tensor_to_proto("bias_update", np.asarray(result.bias_update, dtype=np.float64)),
    )


class UpdateBank:
    """The last update of every client of the run, for the Gram matrix Clustered Sampling and DivFL select from.

    Exact: float32 rows of the model's size, the Gram matrix kept up to date row by row in float64 (only the clients
    that trained this round change). `sketch_dim` > 0: a count sketch of that many buckets per client instead (each
    coordinate added with a random sign into a random bucket, fixed per run), whose inner products estimate the
    updates' with variance ~‖g_i‖²‖g_j‖²/sketch_dim, for runs whose N full updates do not fit in memory.
    """

    def __init__(self, num_clients: int, numel: int, sketch_dim: int = 0, seed: int = 0) -> None:
        self.sketch_dim = sketch_dim
        dim = sketch_dim or numel
        self.rows = torch.zeros(num_clients, dim, dtype=torch.float64 if sketch_dim else torch.float32)
        self.gram = np.zeros((num_clients, num_clients))
        if sketch_dim:
            gen = torch.Generator().manual_seed(seed)
            self.bucket = torch.randint(0, sketch_dim, (numel,), generator=gen)
            self.sign = torch.randint(0, 2, (numel,), generator=gen).to(torch.float64) * 2 - 1

    def _row(self, update: torch.Tensor) -> torch.Tensor:
        if not self.sketch_dim:
            return update.to(torch.float32)
        return torch.zeros(self.sketch_dim, dtype=torch.float64).index_add_(0, self.bucket, self.sign * update.double())

    def put(self, updates: dict[int, torch.Tensor]) -> None:
        if not updates:
            return
        ids = sorted(updates)
        self.rows[ids] = torch.stack([self._row(updates[c]) for c in ids])
        # Gram rows of the changed clients, in float64 and in blocks of clients to bound the temporaries.
        changed = self.rows[ids].double()
        block = max(1, (1 << 25) // max(self.rows.shape[1], 1))
        for start in range(0, self.rows.shape[0], block):
            part = (changed @ self.rows[start : start + block].double().T).numpy()
            self.gram[ids, start : start + part.shape[1]] = part
            self.gram[start : start + part.shape[1], ids] = part.T

    def similarity(self, candidates: Sequence[int]) -> NDArray[np.float64]:
        return self.gram[np.ix_(candidates, candidates)].copy()


class SelectionDriver:
    """The engine's side of selection: builds each round's request, runs power-of-choice's probe, feeds signatures
    and updates back. Selection time (the Select calls, not the probe's client work) is returned per round."""

    def __init__(self, config: ExperimentConfig, selector: Selector, numel: int) -> None:
        sel = config.selection
        self.method = sel.method
        self.selector = selector
        sampler = sel.sampler_class()
        # Every selection of the run is sent these (what the run supplies filled in, e.g. HiCS-FL's total_rounds).
        self.params = sampler.run_params(sel.sampler_params(), config)
        self.wants_bias_update = "bias_update" in sampler.client_signatures
        self.bank: UpdateBank | None = None
        if sampler.needs_similarity:
            sketch_dim = sampler.similarity_sketch_dim(self.params)
            self.bank = UpdateBank(config.data.num_clients, numel, sketch_dim, config.seed)
        self.sizes: dict[int, int] = {}  # training samples of every client that has trained

    def select(
        self,
        run_id: str,
        round_number: int,
        candidates: list[int],
        count: int,
        seed: int,
        probe_losses: Callable[[list[int]], dict[int, float]],
    ) -> tuple[list[int], float]:
        context = SelectionContext(
            run_id,
            round_number,
            candidates,
            count,
            seed,
            self.params,
            num_samples=[self.sizes.get(c, 0) for c in candidates],
            similarity=None if self.bank is None else self.bank.similarity(candidates),
        )
        started = time.perf_counter()
        out = self.selector.select(context)
        seconds = time.perf_counter() - started
        if out.needs_losses:
            losses = probe_losses(list(out.selected))
            if not losses:
                raise RuntimeError(f"round {round_number}: no candidate answered the power-of-choice loss probe")
            probed = sorted(losses)
            context = replace(
                context,
                candidates=probed,
                count=min(count, len(probed)),
                num_samples=None,
                losses=[losses[c] for c in probed],
            )
            started = time.perf_counter()
            out = self.selector.select(context)
            seconds += time.perf_counter() - started
            if out.needs_losses:
                raise RuntimeError(f"round {round_number}: the selector asked for losses twice")
        # Sorted; Clustered Sampling may draw a client twice, and the repeat stays (the engine trains it once, a
        # draw-weighted strategy such as cluster2 counts it twice).
        return sorted(out.selected), seconds

    def state_dict(self) -> dict[str, Any]:
        """For the aggregator's checkpoint: clients' data sizes and the update bank (Clustered Sampling, DivFL)."""
        ids = sorted(self.sizes)
        state: dict[str, Any] = {"sizes": np.array([ids, [self.sizes[c] for c in ids]], dtype=np.int64)}
        if self.bank is not None:
            state["bank_rows"] = self.bank.rows
            state["bank_gram"] = self.bank.gram
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ids, sizes = np.asarray(state["sizes"], dtype=np.int64).reshape(2, -1)
        self.sizes = dict(zip(ids.tolist(), sizes.tolist(), strict=True))
        if self.bank is not None and "bank_rows" in state:
            rows = torch.as_tensor(np.asarray(state["bank_rows"]))
            if rows.shape != self.bank.rows.shape:
                raise ValueError(
                    f"checkpoint's update bank is {list(rows.shape)}, this run's {list(self.bank.rows.shape)}"
                )
            self.bank.rows.copy_(rows)
            self.bank.gram[:] = np.asarray(state["bank_gram"])

    def observe(self, run_id: str, results: Sequence[ClientResult]) -> None:
        """After training: sizes, HiCS-FL signatures to the selector, updates to the bank."""
        for r in results:
            self.sizes[r.client_id] = r.num_samples
        if self.wants_bias_update:
            signatures = [signature_proto(r) for r in results if r.bias_update is not None]
            if signatures:
                self.selector.report_signatures(run_id, signatures)
        if self.bank is not None:
            self.bank.put({r.client_id: r.payloads[UPDATE] for r in results if UPDATE in r.payloads})
