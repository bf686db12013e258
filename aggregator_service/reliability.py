"""The aggregator's reliability settings (docs/reliability.md): checkpoints, agent liveness and its worker pool."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from aggregator_service.federation.state import AGENT_TIMEOUT_S, HEARTBEAT_INTERVAL_S

DEFAULT_MAX_WORKERS = 64
# Workers a long poll may never take: results, heartbeats, model fetches and run control always find one free. Of the
# pool, fairfl.rpc_guard.server_limits also keeps 1/16 free of every call (so calls over a limit are refused at once)
# and lets one caller hold at most half of the rest (--max-in-flight).
RESERVED_WORKERS = 16


@dataclass(frozen=True)
class ReliabilityOptions:
    checkpoint_dir: str = ""  # checkpoint every run under <dir>/<run id>/ and resume unfinished ones at start
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S  # told to agents when they register
    agent_timeout: float = AGENT_TIMEOUT_S  # an agent silent this long has vanished
    max_workers: int = DEFAULT_MAX_WORKERS  # gRPC server threads

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.agent_timeout:
            raise ValueError(
                f"--agent-timeout ({self.agent_timeout:g}s) must exceed --heartbeat-interval "
                f"({self.heartbeat_interval:g}s), which must be > 0"
            )
        if self.max_workers <= RESERVED_WORKERS:
            raise ValueError(f"--max-workers must exceed {RESERVED_WORKERS} (workers kept free of long polls)")

    @property
    def max_long_polls(self) -> int:
        """Agents that can wait in a long poll at once; more agents still work, polling without waiting."""
        return self.max_workers - RESERVED_WORKERS


def add_reliability_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--checkpoint-dir",
        default=env("FAIRFL_CHECKPOINT_DIR", ""),
        help="checkpoint every run under DIR/<run id>/ after each round and resume unfinished runs found there at "
        "start (env FAIRFL_CHECKPOINT_DIR; empty: only runs that set runtime.checkpoint_dir are checkpointed)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=float(env("FAIRFL_HEARTBEAT_INTERVAL", str(HEARTBEAT_INTERVAL_S))),
        help="seconds between agent heartbeats (env FAIRFL_HEARTBEAT_INTERVAL)",
    )
    parser.add_argument(
        "--agent-timeout",
        type=float,
        default=float(env("FAIRFL_AGENT_TIMEOUT", str(AGENT_TIMEOUT_S))),
        help="an agent silent this long has vanished: its clients leave the round (env FAIRFL_AGENT_TIMEOUT)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=int(env("FAIRFL_AGGREGATOR_WORKERS", str(DEFAULT_MAX_WORKERS))),
        help=f"gRPC worker threads; up to this minus {RESERVED_WORKERS} agents wait in long polls at once, more "
        "poll without waiting; one caller may run half of the threads less 1/16 at once unless --max-in-flight "
        "says otherwise (env FAIRFL_AGGREGATOR_WORKERS)",
    )


def options_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ReliabilityOptions:
    try:
        return ReliabilityOptions(args.checkpoint_dir, args.heartbeat_interval, args.agent_timeout, args.max_workers)
    except ValueError as err:
        parser.error(str(err))
        raise  # parser.error exits; for type checkers
