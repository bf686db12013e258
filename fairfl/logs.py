"""Logging set-up shared by every FairFL process: one text format for people, or one JSON object per line for log
collectors (`--log-format json`, env FAIRFL_LOG_FORMAT; every service takes the option, every process the variable).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

__all__ = [
    "ENV_LOG_FORMAT",
    "LOG_FORMATS",
    "JsonFormatter",
    "add_log_format_argument",
    "configure_logging",
    "log_format",
]

ENV_LOG_FORMAT = "FAIRFL_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname).1s %(name)s[%(process)d] %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (ISO 8601, UTC, milliseconds), level, logger, pid, message, and
    exc_info (the formatted traceback) / stack_info when the record has them. Newlines inside the message are
    escaped by JSON, so a record never spans lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        del datefmt
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{seconds}.{int(record.msecs):03d}Z"


def log_format(fmt: str | None = None) -> str:
    """`fmt`, or $FAIRFL_LOG_FORMAT when `fmt` is None or empty, else text; ValueError (one line) for another word."""
    raw = fmt or os.environ.get(ENV_LOG_FORMAT, "")
    chosen = (raw or "text").strip().lower()
    if chosen not in LOG_FORMATS:
        source = "--log-format" if fmt else ENV_LOG_FORMAT
        raise ValueError(f"{source} must be one of {', '.join(LOG_FORMATS)}, got {raw!r}")
    return chosen


def configure_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """One log format for every process, so interleaved output of a local run stays readable: `fmt` 'text' (default)
    or 'json'; None reads FAIRFL_LOG_FORMAT. Raises ValueError for an unknown format."""
    chosen = log_format(fmt)
    handler = logging.StreamHandler()
    if chosen == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def add_log_format_argument(parser: argparse.ArgumentParser) -> None:
    """`--log-format text|json` (default: $FAIRFL_LOG_FORMAT, else text); pass `args.log_format` to
    configure_logging."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="text (default) or json: one JSON object per line (time, level, logger, pid, message); "
        f"env {ENV_LOG_FORMAT}",
    )
