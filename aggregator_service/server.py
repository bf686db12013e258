"""Aggregator process: the Federation API for agents and the RunControl API for users, on one port."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import cast

import grpc
import torch

from aggregator_service.checkpoint import RunCheckpointer, find_unfinished
from aggregator_service.clustering_peer import RemoteClusterer
from aggregator_service.engine import PrivacyGate, RoundEngine, Selector
from aggregator_service.federation.handlers import add_federation_servicer
from aggregator_service.federation.servicer import SERVICE_NAME as FEDERATION_SERVICE
from aggregator_service.federation.servicer import FederationServicer
from aggregator_service.federation.state import FederationState
from aggregator_service.federation.transport import GrpcTransport
from aggregator_service.monitoring import InstrumentedTransport, RunMonitor, TimedPrivacy, TimedSelector, TimedStrategy
from aggregator_service.peers import NoLedger, RemotePrivacy, RemoteSelector
from aggregator_service.reliability import ReliabilityOptions, add_reliability_arguments, options_from_args
from aggregator_service.runs import SERVICE_NAME as CONTROL_SERVICE
from aggregator_service.runs import RunControlServicer, RunManager
from fairfl import telemetry, tls
from fairfl.announce import announcement
from fairfl.config import ExperimentConfig
from fairfl.logs import add_log_format_argument, configure_logging
from fairfl.privacy import process_randomness
from fairfl.rpc_guard import IDLE_TIMEOUT_S, AccessPolicy, add_limit_arguments, check_limits
from fairfl.rpc_security import TransportSecurity, add_transport_arguments, transport_from_args
from fairfl.rpc_server import RunningServer, serve_until_signal, start_server
from fairfl.strategy import Strategy
from fairfl.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAMES = [FEDERATION_SERVICE, CONTROL_SERVICE]
CLUSTERING_REQUIRED = (
    "--clustering ADDRESS (env FAIRFL_CLUSTERING_ADDRESS) is required: the clustering service selects every round's "
    "clients; start one with `python -m clustering_service` (`fairfl run` and deploy/k8s do), or run in-process with "
    "`fairfl run --transport inprocess`"
)


class Aggregator:
    def __init__(
        self, clustering_address: str = "", privacy_address: str = "", options: ReliabilityOptions | None = None
    ) -> None:
        if not clustering_address:
            # Selection and clustering run in the clustering service (a user's sampler too); a service never runs
            # another service's code, so the aggregator cannot select on its own.
            raise ValueError(CLUSTERING_REQUIRED)
        self.options = options or ReliabilityOptions()
        self.state = FederationState(
            self.options.heartbeat_interval, self.options.agent_timeout, self.options.max_long_polls
        )
        self.clustering_address = clustering_address
        self.privacy_address = privacy_address
        self.manager = RunManager(
            self._make_engine, on_stop=self.state.wake, checkpoint_dir=self.options.checkpoint_dir
        )
        telemetry.enable("aggregator")
        telemetry.CONNECTED_CLIENTS.set_function(lambda: len(self.state.live_clients()))
        telemetry.CONNECTED_AGENTS.set_function(self.state.live_agents)

    def _make_engine(
        self,
        run_id: str,
        config: ExperimentConfig,
        on_event: Callable[[control_pb2.RunEvent], None],
        stop: threading.Event,
    ) -> RoundEngine:
        selector: Selector = RemoteSelector(self.clustering_address, config.selection.method)
        # Without a privacy service only non-private runs can go (NoLedger refuses a DP run before round 1).
        privacy: PrivacyGate = RemotePrivacy(self.privacy_address) if self.privacy_address else NoLedger()
        monitor = RunMonitor(run_id, config)

        def record(event: control_pb2.RunEvent) -> None:
            monitor(event)
            on_event(event)

        engine = RoundEngine(
            run_id,
            config,
            InstrumentedTransport(GrpcTransport(self.state)),
            TimedSelector(selector),
            TimedPrivacy(privacy),
            record,
            stop,
            dp_randomness=process_randomness(),  # FAIRFL_DP_RANDOMNESS, default secure (see fairfl.privacy)
            clusterer=RemoteClusterer(self.clustering_address),
        )
        engine.strategy = cast(Strategy, TimedStrategy(engine.strategy))
        directory = self.manager.checkpoint_directory(run_id, config)
        if directory is not None:
            engine.checkpointer = RunCheckpointer(directory, run_id, config)
        return engine

    def resume_unfinished(self) -> str | None:
        """Resume the most recently checkpointed run that had not ended (one run is active at a time); its id."""
        if not self.options.checkpoint_dir:
            return None
        found = find_unfinished(self.options.checkpoint_dir)
        for other in found[1:]:
            log.warning("run %s also has an unfinished checkpoint; StartRun with its id resumes it", other.run_id)
        if not found:
            return None
        latest = found[0]
        log.info("resuming run %s from its checkpoint in %s", latest.run_id, latest.directory)
        self.manager.start(latest.config, latest.run_id, resume=latest)
        return latest.run_id

    def register(self, server: grpc.Server) -> list[str]:
        add_federation_servicer(FederationServicer(self.state), server)  # data chunks as raw bytes
        control_pb2_grpc.add_RunControlServicer_to_server(RunControlServicer(self.manager), server)
        return SERVICE_NAMES


def access_policy(
    rate: float = 200.0, burst: int = 1000, max_in_flight: int = 0, idle_timeout: float = IDLE_TIMEOUT_S
) -> AccessPolicy:
    """Agents use the Federation API, services and operators (service certificates) RunControl. Every Federation
    method but the long-poll is rate limited per caller; PollTasks waits by design and each agent holds one. Every
    call, PollTasks included, counts against the caller's `max_in_flight` (0: half of the pool, see
    fairfl.rpc_guard.server_limits; 30 of 64 workers): one agent runs at most 14 calls at once (client_agent.agent: a
    poll, a heartbeat, 4 fetch streams, 8 result uploads), so agents sharing a certificate share that
    (docs/security.md)."""
    limited = ("Register", "Heartbeat", "GetRunSpec", "FetchBlob", "SubmitResult", "SubmitResults", "UploadResult")
    return AccessPolicy(
        roles={FEDERATION_SERVICE: frozenset({tls.ROLE_AGENT}), CONTROL_SERVICE: frozenset({tls.ROLE_SERVICE})},
        rate_limited=frozenset(f"/{FEDERATION_SERVICE}/{m}" for m in limited),
        rate=rate,
        burst=burst,
        max_in_flight=max_in_flight,
        idle_timeout=idle_timeout,
    )


def serve(
    bind: str,
    clustering_address: str = "",
    privacy_address: str = "",
    security: TransportSecurity | None = None,
    policy: AccessPolicy | None = None,
    health_bind: str = "",
    options: ReliabilityOptions | None = None,
) -> tuple[RunningServer, Aggregator]:
    aggregator = Aggregator(clustering_address, privacy_address, options)
    running = start_server(
        bind,
        aggregator.register,
        max_workers=aggregator.options.max_workers,
        security=security,
        policy=policy or access_policy(),
        health_bind=health_bind,
    )
    return running, aggregator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aggregator_service", description="FairFL aggregator")
    parser.add_argument("--bind", default=os.environ.get("FAIRFL_AGGREGATOR_BIND", "0.0.0.0:50051"))
    parser.add_argument(
        "--clustering",
        default=os.environ.get("FAIRFL_CLUSTERING_ADDRESS", ""),
        help="clustering service address (required: it selects every round's clients); env FAIRFL_CLUSTERING_ADDRESS",
    )
    parser.add_argument(
        "--privacy",
        default=os.environ.get("FAIRFL_PRIVACY_ADDRESS", ""),
        help="privacy service address; empty = non-private runs only (a DP run is refused)",
    )
    parser.add_argument("--log-level", default=os.environ.get("FAIRFL_LOG_LEVEL", "INFO"))
    add_log_format_argument(parser)
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("FAIRFL_THREADS", "1")),
        help="torch intra-op threads for aggregation (default 1: results are folded on concurrent handler threads "
        "and a large model's fold splits into ranges on its own threads; an intra-op team on a machine whose cores "
        "are busy training stalls every kernel waiting for a descheduled member); env FAIRFL_THREADS",
    )
    telemetry.add_metrics_arguments(parser)
    add_transport_arguments(parser)
    add_limit_arguments(parser)
    add_reliability_arguments(parser)
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as err:  # FAIRFL_LOG_FORMAT names no format
        parser.error(str(err))
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if not args.clustering:
        parser.error(CLUSTERING_REQUIRED)
    torch.set_num_threads(args.threads)
    security = transport_from_args(parser, args)  # also the identity it dials clustering and privacy with
    metrics = telemetry.start_from_args(args, "aggregator")
    policy = access_policy(args.rate_limit, args.rate_burst, args.max_in_flight, args.idle_timeout)
    options = options_from_args(parser, args)
    check_limits(parser, policy, options.max_workers)
    running, aggregator = serve(args.bind, args.clustering, args.privacy, security, policy, args.health_bind, options)
    try:
        aggregator.resume_unfinished()
    except Exception:  # a broken checkpoint must not keep the aggregator down: new runs still start
        log.exception("could not resume the unfinished run in %s", options.checkpoint_dir)
    # Launchers asking for port 0 read the bound ports from this line.
    print(announcement(running.port, metrics), flush=True)
    serve_until_signal(running, SERVICE_NAMES, before_drain=aggregator.state.shut_down)
    return 0


if __name__ == "__main__":
    sys.exit(main())
