"""Logging set-up shared by every FairFL process."""

from __future__ import annotations

import logging


def configure_logging(level: str = "INFO") -> None:
    """One log format for every process, so interleaved output of a local run stays readable."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname).1s %(name)s[%(process)d] %(message)s",
        datefmt="%H:%M:%S",
    )
