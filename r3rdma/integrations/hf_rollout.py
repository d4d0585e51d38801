"""A rollout driver for Hugging Face MoE models that feeds the capturer real step mappings.

It batches prompts of different lengths (left-padded), prefills them in one forward, then
decodes with a KV cache until every request ends by EOS or its token budget. KV slots come
from a paged block allocator (``block_id * block_size + offset``) whose freed blocks are reused
by later waves, as an engine's would be; the capturer's slot table is indexed by those slots.

Why not ``model.generate_batch``: see docs/INTEGRATION.md (its per-step batch state is private).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from r3rdma.capture.capturer import RoutingCapturer
from r3rdma.errors import ConfigError
from r3rdma.ids import validate_id

__all__ = ["RolloutRequest", "RolloutOutput", "StepInfo", "SampleInfo", "BlockAllocator", "HFRolloutDriver", "cache_argument"]


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes its KV cache object.

    transformers 5.x names it ``past_key_values`` (annotated ``Cache | None``). Should a release
    rename it, the renamed parameter (annotated ``Cache``, not ``past_key_values``) is taken, so
    the deprecated name (and its ``FutureWarning``) is not used; ``past_key_values`` otherwise.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    for name, param in params.items():
        annotation = param.annotation.__name__ if isinstance(param.annotation, type) else str(param.annotation)
        if (
            name != "past_key_values"
            and "Cache" in annotation
            and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
        ):
            return name
    return "past_key_values"


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One request to generate: its id, prompt token ids, and how many tokens it may generate at most."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class RolloutOutput:
    """One finished request: its prompt, the tokens generated, and why it stopped."""

    request_id: str
    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    finish_reason: str  # "eos" or "length"


@dataclass(frozen=True, slots=True, eq=False)
class StepInfo:
    """What one forward computed: per request, positions ``start .. start + count - 1``.

    ``router_rows[t]`` is the row of the router's flattened input that computed token t.
    """

    request_ids: tuple[str, ...]
    start_positions: tuple[int, ...]
    num_tokens: tuple[int, ...]
    router_rows: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class SampleInfo:
    """Tokens sampled in one step: request ``request_ids[i]`` got ``tokens[i]`` at position
    ``positions[i]``, with log-probability ``logprobs[i]`` under the sampling distribution
    (``log_softmax(logits / temperature)``; plain ``log_softmax`` when greedy), in fp32 on CPU."""

    request_ids: tuple[str, ...]
    positions: tuple[int, ...]
    tokens: torch.Tensor
    logprobs: torch.Tensor


class BlockAllocator:
    """Paged KV slots: fixed-size blocks from a free list (LIFO, so freed blocks are reused first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_slots(self) -> int:
        """Every slot of the cache, free or not: ``num_blocks * block_size`` (the capturer needs at least as many)."""
        return self.num_blocks * self.block_size

    def slots(self, request_id: str, start: int, count: int) -> list[int]:
        """Slots of positions ``start .. start + count - 1``, allocating blocks as needed."""
        table = self._tables.setdefault(request_id, [])
        end = start + count
        while len(table) * self.block_size < end:
            if not self._free:
                raise ConfigError(f"KV cache exhausted: {self.num_blocks} blocks of {self.block_size} in use")
            table.append(self._free.pop())
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def free(self, request_id: str) -> None:
        """Give the request's blocks back to the free list (reused first, last block first); an unknown id frees nothing."""
        self._free.extend(reversed(self._tables.pop(request_id, [])))


class HFRolloutDriver:
    """Generates with a HF causal LM, announcing every step to a :class:`RoutingCapturer`.

    ``step_listeners`` are called with each step's :class:`StepInfo` before its forward
    (an independent shadow record uses this in the demo). ``sample_listeners`` are called with
    each step's :class:`SampleInfo` (sampled tokens and their log-probabilities).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        capturer: RoutingCapturer | None,
        *,
        allocator: BlockAllocator,
        batch_size: int = 4,
        eos_token_id: int | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        step_listeners: Sequence[Callable[[StepInfo], None]] = (),
        sample_listeners: Sequence[Callable[[SampleInfo], None]] = (),
    ) -> None:
        if capturer is not None and capturer.num_slots < allocator.num_slots:
            raise ConfigError(f"capturer has {capturer.num_slots} slots, the KV allocator {allocator.num_slots}")
        self.model = model
        self.capturer = capturer
        self.allocator = allocator
        self.batch_size = batch_size
        self.eos_token_id = eos_token_id
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.step_listeners = list(step_listeners)
        self.sample_listeners = list(sample_listeners)
        self._cache_arg = cache_argument(model)

    @torch.no_grad()
    def run(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        """Generate every request, ``batch_size`` at a time (a wave ends when all its requests have), in order.

        :class:`ConfigError` for an empty prompt, ``max_new_tokens < 1`` or a full KV cache; ids are validated first.
        """
        for request in requests:
            validate_id(request.request_id, "request_id")
            if not request.prompt or request.max_new_tokens < 1:
                raise ConfigError(f"request {request.request_id!r} needs a non-empty prompt and max_new_tokens >= 1")
        outputs: list[RolloutOutput] = []
        for first in range(0, len(requests), self.batch_size):
            outputs.extend(self._run_wave(requests[first : first + self.batch_size]))
        return outputs

    def _announce(self, info: StepInfo, slots: list[int]) -> None:
        for listener in self.step_listeners:
            listener(info)
        if self.capturer is not None:
            self.capturer.begin_step(
                info.request_ids, info.start_positions, info.num_tokens, slots, router_rows=info.router_rows.to(self.device)
            )

    def _run_wave(self, wave: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        batch = len(wave)
        lengths = [len(r.prompt) for r in wave]
        width = max(lengths)
        input_ids = torch.zeros((batch, width), dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for b, request in enumerate(wave):
            input_ids[b, width - lengths[b] :] = torch.tensor(request.prompt)
            mask[b, width - lengths[b] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)

        # Prefill: request b's prompt sits in the last lengths[b] columns of row b.
        router_rows = torch.cat([torch.arange(b * width + width - n, (b + 1) * width) for b, n in enumerate(lengths)])
        slots = [s for r, n in zip(wave, lengths) for s in self.allocator.slots(r.request_id, 0, n)]
        info = StepInfo(tuple(r.request_id for r in wave), (0,) * batch, tuple(lengths), router_rows)
        self._announce(info, slots)
        logits = self._step(input_ids, mask, positions, cache)
        generated: list[list[int]] = [[] for _ in wave]
        finish: list[str | None] = [None] * batch
        outputs: dict[int, RolloutOutput] = {}
        while True:
            next_tokens = self._sample(logits)
            if self.sample_listeners:
                self._announce_samples(wave, lengths, generated, finish, logits, next_tokens)
            for b, request in enumerate(wave):
                if finish[b] is not None:
                    continue
                token = int(next_tokens[b])
                generated[b].append(token)
                reason: str | None = None
                if self.eos_token_id is not None and token == self.eos_token_id:
                    reason = "eos"
                elif len(generated[b]) >= request.max_new_tokens:
                    reason = "length"
                if reason is not None:
                    finish[b] = reason
                    if self.capturer is not None:
                        self.capturer.finish_request(request.request_id, prompt_len=lengths[b], generated_len=len(generated[b]))
                    self.allocator.free(request.request_id)
                    outputs[b] = RolloutOutput(request.request_id, request.prompt, tuple(generated[b]), reason)
            active = [b for b in range(batch) if finish[b] is None]
            if not active:
                break
            # Decode: every row feeds its last token (finished rows too, to keep the batch
            # rectangular); only active requests are announced, their token at position len - 1.
            step_ids = torch.tensor([[generated[b][-1] if generated[b] else 0] for b in range(batch)])
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            step_pos = torch.tensor([[lengths[b] + len(generated[b]) - 1] for b in range(batch)])
            starts = tuple(lengths[b] + len(generated[b]) - 1 for b in active)
            slots = [self.allocator.slots(wave[b].request_id, p, 1)[0] for b, p in zip(active, starts)]
            info = StepInfo(tuple(wave[b].request_id for b in active), starts, (1,) * len(active), torch.tensor(active))
            self._announce(info, slots)
            logits = self._step(step_ids, mask, step_pos, cache)
        return [outputs[b] for b in range(batch)]

    def _step(self, input_ids, mask, positions, cache) -> torch.Tensor:
        try:
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **{self._cache_arg: cache},
            )
        except BaseException:
            if self.capturer is not None:
                self.capturer.cancel_step()
            raise
        if self.capturer is not None:
            self.capturer.end_step()
        return out.logits[:, -1, :].float().cpu()

    def _announce_samples(self, wave, lengths, generated, finish, logits, next_tokens) -> None:
        active = [b for b in range(len(wave)) if finish[b] is None]
        scaled = logits / self.temperature if self.temperature > 0 else logits
        logprobs = torch.log_softmax(scaled, dim=-1).gather(1, next_tokens.view(-1, 1)).squeeze(1)
        rows = torch.tensor(active, dtype=torch.long)
        info = SampleInfo(
            tuple(wave[b].request_id for b in active),
            tuple(lengths[b] + len(generated[b]) for b in active),
            next_tokens[rows],
            logprobs[rows],
        )
        for listener in self.sample_listeners:
            listener(info)

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
