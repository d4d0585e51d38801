"""The routing location in a streamed OpenAI response (``"stream": true``).

A non-streamed response carries the location the way vLLM carries any KV-transfer result:
``kv_transfer_params`` of the request's final output becomes the response body's
``kv_transfer_params`` (``{"r3_routing": {...}}``). vLLM's stream chunks have no such field,
so the plug-in adds it to the chunk that ends each choice (the one whose ``finish_reason`` is
set), in the same place and shape as in a non-streamed body::

    data: {"id": "cmpl-...", "object": "text_completion", "created": ..., "model": ...,
           "choices": [{"index": 0, "text": "...", "finish_reason": "length", ...}],
           "kv_transfer_params": {"r3_routing": {"rollout_id": "step-0042",
                                                 "request_id": "sample-17", "rows": 61}}}

With ``n > 1`` each choice's last chunk names that sample (``"key"``, ``"index"``), and lists
the samples finished so far (``"samples"``): the last choice to finish lists them all. With a
list of prompts (``/v1/completions``), each prompt's choices carry their own prompt's location.

How: the serving layer's stream generators (``OpenAIServingCompletion.completion_stream_generator``,
``OpenAIServingChat.chat_completion_stream_generator``) are wrapped. The wrapper watches the
engine outputs the generator consumes (its ``result_generator``) for finished outputs carrying
a location, and adds that location to the chunk the generator then yields for the same
choice with its ``finish_reason``. Only those chunks are parsed and written again; every other
chunk passes through untouched. One more wrapper keeps the location when vLLM merges queued
outputs of one prompt (``RequestOutput.add``, when the stream reads slower than the engine
makes outputs): vLLM keeps the last output's ``kv_transfer_params`` only, so a sample that
finished before another sample's next tokens arrived would lose its location there.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from r3rdma.integrations.vllm.settings import LOCATION_KEY

__all__ = ["install", "stream_with_locations"]

_PARAMS_KEY = "kv_transfer_params"  # the chunk's field, as the non-streamed response names it


def install(wrap: Callable[[type, str, Callable[[Callable], Callable]], None]) -> None:
    """Wrap the OpenAI server's completion and chat stream generators (with the plug-in's
    ``wrap``); nothing where the serving modules cannot be imported (no server here)."""
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError:
        return
    from vllm.outputs import RequestOutput

    wrap(OpenAIServingCompletion, "completion_stream_generator", stream_with_locations)
    wrap(OpenAIServingChat, "chat_completion_stream_generator", stream_with_locations)
    wrap(RequestOutput, "add", _keep_location)


def _keep_location(original: Callable) -> Callable:
    """``RequestOutput.add`` (vLLM merging a queued output with the next one of the same
    prompt), keeping the routing location when the next output has none: the location lists
    the samples finished so far, and a later one lists at least as many."""

    def add(self: Any, next_output: Any, *args: Any, **kwargs: Any) -> Any:
        kept = (self.kv_transfer_params or {}).get(LOCATION_KEY)
        out = original(self, next_output, *args, **kwargs)
        if kept is not None and LOCATION_KEY not in (self.kv_transfer_params or {}):
            self.kv_transfer_params = {**(self.kv_transfer_params or {}), LOCATION_KEY: kept}
        return out

    return add


def stream_with_locations(original: Callable) -> Callable:
    """A stream generator method whose choice-ending chunks carry their routing location."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generator(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        results = bound.arguments.get("result_generator")
        if results is None:
            return original(*args, **kwargs)
        request = bound.arguments.get("request")
        per_prompt = int(getattr(request, "n", None) or 1)  # the serving code numbers choices prompt * n + sample
        finished: dict[int, dict] = {}
        bound.arguments["result_generator"] = _watch(results, finished, per_prompt)
        return _add_locations(original(*bound.args, **bound.kwargs), finished)

    return generator


async def _watch(results: AsyncIterator[Any], finished: dict[int, dict], per_prompt: int) -> AsyncIterator[Any]:
    """``results`` unchanged; each finished output that names its location noted by choice index."""
    try:
        async for item in results:
            # /v1/completions merges its prompts' outputs as (prompt index, output); chat has one prompt.
            prompt, output = item if isinstance(item, tuple) else (0, item)
            params = getattr(output, _PARAMS_KEY, None)
            if params and LOCATION_KEY in params:
                for choice in getattr(output, "outputs", ()):
                    if getattr(choice, "finish_reason", None) is not None:
                        loc = _sample_location(params[LOCATION_KEY], int(choice.index))
                        if loc is not None:
                            finished[int(prompt) * per_prompt + int(choice.index)] = loc
            yield item
    finally:
        close = getattr(results, "aclose", None)
        if close is not None:
            await close()  # the engine's generator aborts its request when closed early


def _sample_location(loc: dict, index: int) -> dict | None:
    """The location of a prompt's sample ``index`` in its output's location: the location
    itself (one sample, or the one it names), else that sample's entry of ``"samples"``, with
    the list (an output vLLM merged from several samples names the last one to finish)."""
    if "index" not in loc or loc["index"] == index:
        return loc
    for sample in loc.get("samples", ()):
        if sample.get("index") == index:
            return {**sample, "samples": loc["samples"]}
    return None


async def _add_locations(chunks: AsyncIterator[str], finished: dict[int, dict]) -> AsyncIterator[str]:
    """``chunks`` (server-sent events), the chunk ending each noted choice carrying its location."""
    try:
        async for chunk in chunks:
            if finished and chunk.startswith("data: {"):
                chunk = _with_location(chunk, finished)
            yield chunk
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


def _with_location(chunk: str, finished: dict[int, dict]) -> str:
    body = json.loads(chunk[len("data: ") :])
    changed = False
    for choice in body.get("choices") or ():
        if choice.get("finish_reason") is None:
            continue
        loc = finished.pop(choice.get("index", 0), None)
        if loc is not None:  # vLLM sends one choice per chunk
            body[_PARAMS_KEY] = {**(body.get(_PARAMS_KEY) or {}), LOCATION_KEY: loc}
            changed = True
    if not changed:
        return chunk
    return "data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n\n"
