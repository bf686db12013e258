"""Errors the clustering service maps onto gRPC status codes (the servicer is the only place that knows about gRPC).

InvalidInput is part of the public sampler API (fairfl.sampling), so a user's sampler raises the same error."""

from __future__ import annotations

from fairfl.sampling import InvalidInput

__all__ = ["InvalidInput"]
