"""The stdout line a FairFL process announces its ports with (`LISTENING <grpc port> [METRICS <metrics port>]`),
written by the services and agents and read back by launchers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fairfl.telemetry import MetricsEndpoint


def announcement(grpc_port: int | None, metrics: MetricsEndpoint | None) -> str:
    """The stdout line launchers read: `LISTENING <grpc port> [METRICS <metrics port>]` or `METRICS <port>`."""
    parts = [] if grpc_port is None else [f"LISTENING {grpc_port}"]
    if metrics is not None:
        parts.append(f"METRICS {metrics.port}")
    return " ".join(parts)


def parse_announcement(line: str) -> tuple[int | None, int | None] | None:
    """(gRPC port, metrics port) from an announcement line; None when the line is not one."""
    words = line.split()
    ports: dict[str, int] = {}
    for key, value in zip(words[::2], words[1::2], strict=False):
        if key not in ("LISTENING", "METRICS") or not value.isdigit():
            return None
        ports[key] = int(value)
    if not ports:
        return None
    return ports.get("LISTENING"), ports.get("METRICS")
