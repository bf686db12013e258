"""The engine's side of the gRPC federation (ClientTransport): publish models, dispatch a phase's tasks to the agents
and wait for its quorum or deadline, folding results as they are accepted. A run whose data is at the sites has the
agents' reported data checked against its declared signature from its start (site_check); the data is never opened.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from aggregator_service.engine import ClientTransport, PhaseOutcome, ResultSink, RunStopped
from aggregator_service.federation.site_check import format_ids, site_run_of
from aggregator_service.federation.state import Batch, FederationState
from fairfl.config import ExperimentConfig
from fairfl.params import ParamLayout
from fairfl.v1 import federation_pb2, tensor_pb2

log = logging.getLogger(__name__)


class GrpcTransport(ClientTransport):
    def __init__(self, state: FederationState) -> None:
        self.state = state
        self.stop = threading.Event()  # the run's stop event (from wait_for_clients): phases end as soon as it is set

    def start_run(self, run_id: str, config: ExperimentConfig, layout: ParamLayout) -> None:
        site_run = site_run_of(run_id, config)  # the plug-in's declaration only: no data is opened
        with self.state.lock:
            self.state.run_id = run_id
            self.state.run_yaml[run_id] = config.to_yaml()
            self.state.layout = layout.with_payload_dtype(config.transport.update_dtype)  # what results travel in
            # Agents registered before the run are checked now; a misfit is dropped and refused when it re-registers.
            for misfit in self.state.admit_sites(site_run):
                log.warning("%s; its registration is dropped", misfit)
        if site_run is not None:
            sites = self.state.site_clients()
            signature = site_run.signature
            log.info(
                "run %s: data at the sites (data.dataset %r: input_shape %s, %d classes); %d sites with %d clients "
                "and %d train samples registered so far",
                run_id,
                site_run.dataset,
                list(signature.input_shape),
                signature.num_classes,
                len({label for label, _, _ in sites.values()}),
                len(sites),
                sum(train for _, train, _ in sites.values()),
            )

    def wait_for_clients(self, num_clients: int, timeout: float, stop: threading.Event) -> None:
        """Until every one of the run's clients is registered; a run whose data is at the sites goes on without the
        missing ones at `timeout` (a site that is down or was refused must not stop the others), any other fails."""
        self.stop = stop
        deadline = time.monotonic() + timeout
        while len(live := [c for c in self.state.live_clients() if c < num_clients]) < num_clients:
            if stop.is_set():
                raise RunStopped("stopped while waiting for clients")
            if time.monotonic() > deadline:
                refused = self.state.refused_sites()
                named = (
                    f"; refused sites: {', '.join(f'{label} ({reason})' for label, reason in refused)}"
                    if refused
                    else ""
                )
                if live and self.state.site_run is not None:
                    missing = sorted(set(range(num_clients)) - set(live))
                    log.warning(
                        "run %s: %d of %d clients registered within %.0fs; going on without clients %s%s",
                        self.state.site_run.run_id,
                        len(live),
                        num_clients,
                        timeout,
                        format_ids(missing),
                        named,
                    )
                    return
                raise TimeoutError(
                    f"only {len(live)} of {num_clients} clients registered within {timeout:.0f}s; "
                    f"start more client agents or lower data.num_clients{named}"
                )
            with self.state.lock:
                self.state.lock.wait(0.2)

    def available_clients(self) -> list[int]:
        return self.state.live_clients()

    def publish(self, flat: torch.Tensor) -> tensor_pb2.BlobRef:
        assert self.state.layout is not None
        return self.state.blobs.put(self.state.layout, flat)

    def execute(
        self,
        tasks: list[federation_pb2.Task],
        timeout: float,
        quorum: int | None = None,
        on_result: ResultSink | None = None,
    ) -> PhaseOutcome:
        state = self.state
        batch = Batch(
            pending={t.task_id: t for t in tasks}, wanted=len(tasks) if quorum is None else quorum, sink=on_result
        )
        deadline = time.monotonic() + timeout
        check_every = min(1.0, state.agent_timeout / 4)  # how soon a vanished agent's tasks close
        with state.lock:
            for task in state.dispatch(tasks):
                del batch.pending[task.task_id]
            for task_id in batch.pending:
                state.open_tasks[task_id] = batch
            state.lock.notify_all()
            while (
                batch.pending
                and len(batch.results) + batch.folding < batch.wanted
                and batch.error is None
                and not self.stop.is_set()
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                state.lock.wait(min(remaining, check_every))
                now = time.monotonic()
                state.resend_vanished(batch, now)  # a crashed co-host's tasks go to a live one
                if batch.pending and all(state.vanished(task_id, now) for task_id in batch.pending):
                    # Nobody left who could answer: close now; those clients may come back in a later round.
                    gone = sorted(t.client_id for t in batch.pending.values())
                    log.info("phase closes early: clients %s vanished mid-round (agent silent or gone)", gone[:20])
                    break
            state.close_pending(batch)  # anything still pending is now late; tasks nobody picked up are withdrawn
            batch.closing = True
            while batch.folding:  # accepted results still being folded in: the aggregate must hold them all
                state.lock.wait()
            if batch.error is not None:
                raise RuntimeError(f"streaming aggregation failed: {batch.error}") from batch.error
            results = [batch.results[c] for c in sorted(batch.results)]
        done = {r.client_id for r in results}
        missing = sorted({t.client_id for t in tasks} - done)
        if missing:
            log.warning("phase closed without results from clients %s", missing[:20])
        return PhaseOutcome(results, missing, rejected=batch.rejected)

    def refused_after_close(self, round_number: int) -> tuple[int, int]:
        return self.state.drain_refused_after_close(round_number)

    def end_run(self, run_id: str) -> None:
        self.state.end_sites(run_id)
        with self.state.lock:
            self.state.blobs.clear()
