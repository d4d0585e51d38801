"""Logging of a store node's processes (the node and its read workers): one format per process,
and the hygiene filter that keeps tokens and client garbage out of the log.

The node's CLI and each read worker call :func:`setup_node_logging` once at start-up; both
import it from here, so neither imports the other.
"""

from __future__ import annotations

import logging
import re
import sys

__all__ = ["install_log_hygiene", "setup_node_logging"]


def setup_node_logging(process: str = "r3rdma-store") -> None:
    """INFO to stderr, each line tagged with ``process``, through the hygiene filter."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {process} %(levelname)s %(message)s", stream=sys.stderr)
    install_log_hygiene()


class _LogHygiene(logging.Filter):
    """Keeps secrets and client garbage out of the node's log.

    aiohttp logs a malformed HTTP request (a client's fault) at ERROR with a traceback and
    the first 100 bytes of the offending line, which can be an ``Authorization`` header:
    such records become one INFO line naming the error type only. Any ``Bearer <value>``
    left in a message is redacted.
    """

    _BEARER = re.compile(r"(Bearer\s+)\S+", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc, HttpProcessingError) and (getattr(exc, "code", 500) or 500) < 500:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "refused a malformed HTTP request (%s)", (type(exc).__name__,)
            record.exc_info = record.exc_text = None
        message = record.getMessage()
        if "earer" in message:
            record.msg, record.args = self._BEARER.sub(r"\1<redacted>", message), ()
        return True


def install_log_hygiene() -> None:
    """Filter every handler of the root logger through :class:`_LogHygiene` (call after logging is set up)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_LogHygiene())
