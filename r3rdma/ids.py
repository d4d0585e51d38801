"""Validation of rollout and request ids.

Ids become storage paths (``<root>/<rollout_id>/...``) and HTTP path components, so they are
checked before any file is touched: ``[A-Za-z0-9._:-]{1,200}``, and neither ``.`` nor ``..``.
"""

from __future__ import annotations

import re

from r3rdma.errors import InvalidIdError

__all__ = ["ID_PATTERN", "MAX_ID_LEN", "validate_id"]

MAX_ID_LEN = 200
ID_PATTERN = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_ID_LEN}}}")


def validate_id(value: object, kind: str = "id") -> str:
    """Return ``value`` if it is a valid id, else raise :class:`InvalidIdError`."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{kind} must be a str, got {type(value).__name__}: {value!r}")
    if not ID_PATTERN.fullmatch(value) or value in (".", "..") or ".." in value:
        shown = value if len(value) <= 60 else value[:60] + f"... ({len(value)} chars)"
        raise InvalidIdError(f"{kind} must match [A-Za-z0-9._:-]{{1,{MAX_ID_LEN}}} and contain no '..'; got {shown!r}")
    return value
