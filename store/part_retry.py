"""A commit refused for one bad record: commit the parts again one by one, so only the bad fail.

A store refuses a whole batch for one bad record (no rows, a conflicting duplicate or segment,
a wrong shape, corrupt bytes: every refusal of the data is a ``ValueError``, r3rdma/errors.py)
and names it. A caller that merged parts into that batch (the
:class:`~r3rdma.write.writer.RoutingWriter` its records, a :class:`~r3rdma.store.node.StoreNode`
the client batches of one group commit) commits each part on its own: the good ones are
stored, and each bad one gets its own error. Any other error is not the records' fault (a
failing disk, a timeout, a lost node): the same cause would fail every part again, so it
fails the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["commit_each", "retry_part_by_part"]

Result = TypeVar("Result")


def retry_part_by_part(error: BaseException, parts: int) -> bool:
    """Whether a commit of ``parts`` parts that raised ``error`` is tried again part by part."""
    return parts > 1 and isinstance(error, ValueError)


def commit_each(commit: Callable[[list], Result], parts: Sequence[list]) -> list[Result | BaseException]:
    """``commit(part)`` for each part in order; per part its result, or the error that refused it."""
    outcomes: list[Result | BaseException] = []
    for part in parts:
        try:
            outcomes.append(commit(part))
        except BaseException as e:
            outcomes.append(e)
    return outcomes
