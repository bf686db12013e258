"""Errors the clustering service maps onto gRPC status codes (the servicer is the only place that knows about gRPC)."""

from __future__ import annotations


class InvalidInput(ValueError):
    """The caller sent something unusable; the message names what and why (→ INVALID_ARGUMENT)."""
