"""Process entry point of the privacy service: a gRPC server over a SQLite ledger."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

import grpc

from fairfl import telemetry, tls
from fairfl.announce import announcement
from fairfl.logs import add_log_format_argument, configure_logging
from fairfl.rpc_guard import DEFAULT_WORKERS, AccessPolicy, add_limit_arguments, check_limits
from fairfl.rpc_security import TransportSecurity, add_transport_arguments, transport_from_args
from fairfl.rpc_server import RunningServer, serve_until_signal, start_server
from fairfl.v1 import privacy_pb2_grpc
from privacy_service.ledger import Ledger, SqliteLedger
from privacy_service.servicer import SERVICE_NAME, PrivacyServicer

log = logging.getLogger(__name__)

DEFAULT_BIND = "0.0.0.0:50053"
DEFAULT_DB = "privacy-ledger.sqlite"


@dataclasses.dataclass
class PrivacyServer(RunningServer):
    """A running privacy server that closes its ledger after the last in-flight call has drained."""

    ledger: Ledger | None = None

    def stop(self, grace: float = 1.0) -> None:
        super().stop(grace)
        if self.ledger is not None:
            self.ledger.close()


# Only services (the aggregator) and operators touch the ledger; agents never call this service.
ACCESS = AccessPolicy(roles={SERVICE_NAME: frozenset({tls.ROLE_SERVICE})})


def serve(
    bind: str,
    db_path: str,
    client_limit: int = telemetry.DEFAULT_CLIENT_LIMIT,
    security: TransportSecurity | None = None,
    health_bind: str = "",
    policy: AccessPolicy = ACCESS,
) -> PrivacyServer:
    """Open (or create) the ledger at `db_path` and serve fairfl.v1.Privacy on `bind` ("host:port", port 0 = any);
    `policy`: ACCESS with the process's limits."""
    telemetry.enable("privacy")
    ledger = SqliteLedger(db_path)

    def register(server: grpc.Server) -> list[str]:
        privacy_pb2_grpc.add_PrivacyServicer_to_server(PrivacyServicer(ledger, client_limit), server)
        return [SERVICE_NAME]

    try:
        running = start_server(bind, register, security=security, policy=policy, health_bind=health_bind)
    except BaseException:
        ledger.close()
        raise
    return PrivacyServer(
        server=running.server,
        port=running.port,
        health=running.health,
        health_server=running.health_server,
        health_port=running.health_port,
        guard=running.guard,
        ledger=ledger,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="privacy_service", description="FairFL privacy service (DP ledger).")
    parser.add_argument(
        "--bind",
        default=os.environ.get("FAIRFL_PRIVACY_BIND", DEFAULT_BIND),
        help="host:port to listen on; port 0 picks a free one (env FAIRFL_PRIVACY_BIND, default %(default)s)",
    )
    parser.add_argument(
        "--db",
        default=os.environ.get("FAIRFL_PRIVACY_DB", DEFAULT_DB),
        help="SQLite ledger file, created if missing (env FAIRFL_PRIVACY_DB, default %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
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
        metrics = telemetry.start_from_args(args, "privacy")
        running = serve(args.bind, args.db, args.metrics_client_limit, security, args.health_bind, policy)
    except Exception as err:  # unusable address or ledger file: say so instead of a traceback
        log.error("cannot start the privacy service: %s", err)
        return 1
    log.info("privacy ledger at %s", os.path.abspath(args.db))
    # Machine-readable line so launchers (and tests) using port 0 learn the bound port.
    print(announcement(running.port, metrics), flush=True)
    serve_until_signal(running, [SERVICE_NAME])
    return 0


if __name__ == "__main__":
    sys.exit(main())
