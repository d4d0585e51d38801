"""What the vLLM plug-in records under, and the start-up refusal of everything else.

An engine with routing replay on either records every token of every step or does not start:
:func:`check_engine` runs in the front end as soon as vLLM has built its config
(``EngineArgs.create_engine_config``, so ``LLM(...)`` and the OpenAI server raise the
:class:`~r3rdma.errors.ConfigError` in the user's process), and again in each worker before
the model loads (an engine core started some other way).

Supported: vLLM's default compilation and CUDA-graph modes (torch.compile, piecewise and full
graphs: the record path is one custom op into a fixed buffer, :mod:`r3rdma.kernels.record_op`),
``enforce_eager``, tensor parallelism, chunked prefill, prefix caching, preemption, n > 1,
and speculative decoding with synchronous scheduling (ngram on any device; other methods with
``async_scheduling=False``). Refused, each by name with what to change:

- Model Runner V2 (vLLM's default on a GPU with Triton): the plug-in wraps the V1 runner.
  ``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1, which runs CUDA graphs and torch.compile too.
- Speculative decoding with asynchronous scheduling: the worker then learns a step's
  positions only on the device (the scheduler runs a step ahead of the acceptance), so the
  host cannot announce which position each token is.
- Pipeline parallelism (each stage holds only its own MoE layers) and data parallelism
  (MoE layers route tokens gathered from every data-parallel rank, padded per rank).
"""

from __future__ import annotations

from typing import Any

from r3rdma.errors import ConfigError

__all__ = ["check_engine", "read", "uses_model_runner_v2"]

V1_HINT = (
    "set VLLM_USE_V2_MODEL_RUNNER=0 in the environment that starts vLLM (the V1 model runner, which runs "
    "CUDA graphs and torch.compile as well)"
)


def uses_model_runner_v2(vllm_config: Any) -> bool:
    """Whether vLLM will run Model Runner V2 for this config (its own decision, not a guess)."""
    return bool(read(vllm_config, "use_v2_model_runner", "VllmConfig"))


def check_engine(vllm_config: Any) -> None:
    """Raise :class:`ConfigError` unless the plug-in records every token this engine computes.

    Every field it decides on is read as vLLM names it, with no default: a field a vLLM
    release renamed or removed stops the engine with a ``ConfigError`` naming it, rather than
    reading as "not used" and letting an engine start that the plug-in cannot record."""
    if uses_model_runner_v2(vllm_config):
        raise ConfigError(
            "routing replay is on, but this engine will run vLLM's Model Runner V2 (vLLM's default on a "
            "GPU with Triton), which r3rdma's plug-in does not hook, so nothing would be recorded: " + V1_HINT
        )
    parallel = read(vllm_config, "parallel_config", "VllmConfig")
    pipeline = read(parallel, "pipeline_parallel_size", "ParallelConfig")
    data = read(parallel, "data_parallel_size", "ParallelConfig")
    if pipeline > 1:
        raise ConfigError(
            "r3rdma's vLLM plug-in does not support pipeline parallelism yet "
            f"(pipeline_parallel_size={pipeline}); each stage holds only its own MoE layers"
        )
    if data > 1:
        raise ConfigError(
            "r3rdma's vLLM plug-in does not support data parallelism yet "
            f"(data_parallel_size={data}): MoE layers then route the tokens of "
            "every data-parallel rank together; run one engine per rank instead"
        )
    spec = read(vllm_config, "speculative_config", "VllmConfig")
    async_scheduling = read(read(vllm_config, "scheduler_config", "VllmConfig"), "async_scheduling", "SchedulerConfig")
    if spec is not None and async_scheduling:
        raise ConfigError(
            f"r3rdma's vLLM plug-in records speculative decoding ({read(spec, 'method', 'SpeculativeConfig')}) with "
            "synchronous scheduling only: with async scheduling the worker learns which drafts were accepted only on "
            "the device, so it cannot tell which position each token is. Start vLLM with async_scheduling=False "
            "(--no-async-scheduling), or use ngram, which schedules synchronously"
        )


def read(config: Any, field: str, owner: str) -> Any:
    """``config.<field>`` of vLLM's ``owner`` config class, or a :class:`ConfigError` naming
    the field if this vLLM has none by that name (renamed or removed in a release the
    plug-in's checks were not written against)."""
    try:
        return getattr(config, field)
    except AttributeError as e:
        import vllm

        raise ConfigError(
            f"r3rdma's vLLM plug-in reads {owner}.{field} to decide whether it can record this engine, and this "
            f"vLLM ({vllm.__version__}) has no such field ({type(config).__name__} has none): a release that renamed "
            "or removed it needs the plug-in updated (r3rdma.integrations.vllm.engine_gate) before routing replay can run"
        ) from e
