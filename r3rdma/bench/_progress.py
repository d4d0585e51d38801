"""tqdm progress over a bench's rounds, on stderr, only when stderr is a terminal."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def rounds_bar(rounds: int, name: str):
    return tqdm(range(rounds), desc=f"bench {name}", unit="round", file=sys.stderr, disable=not sys.stderr.isatty(),
                leave=False)
