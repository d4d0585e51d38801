"""The task of ``r3rdma rl-loop``: copy a short quoted word, on ``train-tiny``'s byte tokenizer.

A prompt is a fixed two-line header (the same in every prompt of every step: a shared system
prompt, so prefix caching has blocks to share within a step and, were it not reset, across a
weight update) followed by ``a = '<word>'\\nb = '``; the answer is ``<word>'``. The reward of a
completion scores the answer's bytes position by position, with partial credit for letters
(:meth:`CopyTask.reward`; dense, in [0, 1]: a GRPO group of samples nearly always has some
spread, even from a model that copies nothing yet). Token ids are the prompt's
UTF-8 bytes, as ``train-tiny`` trained on, so no tokenizer runs on either side.

Words are drawn, seeded, from a small pool: prompts recur from step to step, as a data set's
prompts do over epochs. The probe prompt (:data:`PROBE_WORD`) is added to every step as one
greedy request of one token with the engine's top log-probabilities: the step-to-step change of
those log-probabilities shows the engine serves the pushed weights.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

__all__ = ["HEADER", "PROBE_WORD", "CopyPrompt", "CopyTask"]

HEADER = "# Copy the word between the quotes of a into b, then close the quote.\n# b must hold exactly the same word as a.\n"
PROBE_WORD = "probe"


@dataclass(frozen=True, slots=True)
class CopyPrompt:
    """One prompt: its word, its token ids (bytes) and the answer's token ids."""

    word: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]


class CopyTask:
    """Prompts and rewards of the copy task.

    Args:
        pool: distinct words prompts are drawn from (seeded).
        word_len: letters per word.
        seed: seeds the pool and each step's draw.
    """

    def __init__(self, *, pool: int = 16, word_len: int = 4, seed: int = 0) -> None:
        if pool < 1 or word_len < 1:
            raise ValueError(f"pool and word_len must be >= 1, got pool={pool}, word_len={word_len}")
        rng = random.Random(seed)
        words: list[str] = []
        while len(words) < pool:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(word_len))
            if w not in words and w != PROBE_WORD:
                words.append(w)
        self.words = words
        self.word_len = word_len
        self.seed = seed

    @staticmethod
    def prompt(word: str) -> CopyPrompt:
        """The prompt and answer of ``word``."""
        text = f"{HEADER}a = '{word}'\nb = '"
        return CopyPrompt(word, tuple(text.encode()), tuple(f"{word}'".encode()))

    @property
    def header_len(self) -> int:
        """Tokens of the header every prompt starts with."""
        return len(HEADER.encode())

    @property
    def max_new_tokens(self) -> int:
        """Tokens generated per sample: the answer's length (the word and its closing quote)."""
        return self.word_len + 1

    def draw(self, step: int, count: int) -> list[CopyPrompt]:
        """``count`` distinct prompts of step ``step`` (seeded by the task's seed and the step)."""
        if count > len(self.words):
            raise ValueError(f"{count} prompts per step need a pool of at least {count} words, got {len(self.words)}")
        rng = random.Random(self.seed * 1_000_003 + step)
        return [self.prompt(w) for w in rng.sample(self.words, count)]

    def probe(self) -> CopyPrompt:
        """The probe prompt, the same at every step."""
        return self.prompt(PROBE_WORD)

    @staticmethod
    def reward(prompt: CopyPrompt, generated: tuple[int, ...] | list[int]) -> float:
        """The mean over the answer's positions of: 1 for the answer's byte; for a letter of the
        word, 0.5 for another letter of the word and 0.25 for any other lowercase letter
        (partial credit: a model that does not copy yet still has a gradient towards it)."""
        answer = prompt.answer_ids
        letters = set(prompt.word.encode())
        score = 0.0
        for a, g in zip(answer, generated):
            if g == a:
                score += 1.0
            elif a in letters and g in letters:
                score += 0.5
            elif a in letters and ord("a") <= g <= ord("z"):
                score += 0.25
        return score / len(answer)
