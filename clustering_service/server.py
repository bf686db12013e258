"""Process entry point: `python -m clustering_service --bind HOST:PORT`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import grpc

from clustering_service.servicer import SERVICE_NAME, ClusteringServicer
from clustering_service.state import StateStore
from fairfl import telemetry, tls
from fairfl.announce import announcement
from fairfl.logs import add_log_format_argument, configure_logging
from fairfl.rpc_guard import DEFAULT_WORKERS, AccessPolicy, add_limit_arguments, check_limits
from fairfl.rpc_security import TransportSecurity, add_transport_arguments, transport_from_args
from fairfl.rpc_server import RunningServer, serve_until_signal, start_server
from fairfl.v1 import clustering_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_BIND = "0.0.0.0:50052"
BIND_ENV = "FAIRFL_CLUSTERING_BIND"


# Only services (the aggregator) and operators select and cluster; agents never call this service.
ACCESS = AccessPolicy(roles={SERVICE_NAME: frozenset({tls.ROLE_SERVICE})})


def serve(
    bind: str,
    store: StateStore | None = None,
    client_limit: int = telemetry.DEFAULT_CLIENT_LIMIT,
    security: TransportSecurity | None = None,
    health_bind: str = "",
    policy: AccessPolicy = ACCESS,
) -> RunningServer:
    """Start the Clustering service (plus health and reflection) on `bind`; port 0 picks a free port. `policy`: ACCESS
    with the process's limits."""
    telemetry.enable("clustering")
    servicer = ClusteringServicer(store, client_limit)

    def register(server: grpc.Server) -> list[str]:
        clustering_pb2_grpc.add_ClusteringServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return start_server(bind, register, security=security, policy=policy, health_bind=health_bind)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clustering_service", description="FairFL client selection and clustering")
    parser.add_argument(
        "--bind",
        default=os.environ.get(BIND_ENV, DEFAULT_BIND),
        help=f"host:port to listen on; port 0 picks a free one (default: ${BIND_ENV} or {DEFAULT_BIND})",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    add_log_format_argument(parser)
    telemetry.add_metrics_arguments(parser, client_limit=True)
    add_transport_arguments(parser)
    add_limit_arguments(parser, rate=False)
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as err:  # FAIRFL_LOG_FORMAT names no format
        parser.error(str(err))
    security = transport_from_args(parser, args)
    policy = dataclasses.replace(ACCESS, max_in_flight=args.max_in_flight, idle_timeout=args.idle_timeout)
    check_limits(parser, policy, DEFAULT_WORKERS)
    try:
        metrics = telemetry.start_from_args(args, "clustering")
        running = serve(
            args.bind,
            client_limit=args.metrics_client_limit,
            security=security,
            health_bind=args.health_bind,
            policy=policy,
        )
    except (OSError, RuntimeError) as err:  # grpcio raises RuntimeError when the address cannot be bound
        log.error("cannot start the clustering service on %s: %s", args.bind, err)
        return 1
    # Parents that asked for port 0 read the real ports from this line; logs go to stderr, so stdout stays parseable.
    print(announcement(running.port, metrics), flush=True)
    serve_until_signal(running, [SERVICE_NAME])
    log.info("clustering service stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
