"""The RL loop's hands inside a live vLLM engine: new weights in between rollouts, old rollouts out.

verl and OpenRLHF keep one engine for the whole run and, after each optimizer step, hand the
trainer's weights to every worker, which loads them into the model it serves
(``model_runner.model.load_weights(weights=[(name, tensor), ...])``, reached through
``LLM.collective_rpc`` or the in-process executor), then reset the prefix cache: KV computed
by the old weights must not be reused. Here the same runs through vLLM's public hooks:

- :class:`RLWorker` is a vLLM *worker extension* (``LLM(worker_extension_cls=
  "r3rdma.cli.rl_worker.RLWorker")``): vLLM mixes it into its worker class, in every worker
  process, so its methods are worker methods ``LLM.collective_rpc`` calls by name.
- :func:`push_weights` sends the trainer's state dict, in the checkpoint's own parameter names
  (transformers' reverse of its load-time conversion, what ``save_pretrained`` writes, so the
  names are the ones vLLM loaded at start), as one safetensors blob per call through
  ``collective_rpc`` (vLLM's RPC carries bytes as they are; it would not carry tensors inside
  a list). Each worker loads it with vLLM's in-place reload where its model runner has one
  taking weights (``reload_weights(weights_iterator=..., is_checkpoint_format=True)``, vLLM
  0.32), which re-runs each layer's weight processing and copies the result into the tensors
  the engine holds. That matters on vLLM's CPU backend, which repacks weights after loading
  (linear layers into oneDNN handles, leaving a 0-element ``weight``; MoE experts into a
  prepacked layout): a bare ``load_weights`` fails there ("Attempted to load weight
  (torch.Size([16, 64])) into parameter (torch.Size([0]))"). Without such a reload (older
  releases), ``model_runner.model.load_weights(weights)``: verl's path, for GPU backends that
  use the checkpoint's layout.

Large models would stream chunks or use CUDA IPC / NCCL instead of one blob (as verl does);
the engine-side call is the same.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

__all__ = ["RLWorker", "checkpoint_state_dict", "push_weights", "EXTENSION"]

#: What to pass as ``LLM(worker_extension_cls=...)``.
EXTENSION = "r3rdma.cli.rl_worker.RLWorker"


class RLWorker:
    """vLLM worker extension: methods ``LLM.collective_rpc`` calls on every worker.

    Mixed into vLLM's worker class, so ``self`` is the worker (``self.model_runner`` its
    model runner). Method names carry an ``r3rl_`` prefix: vLLM refuses an extension whose
    attributes collide with the worker's."""

    model_runner: Any  # the worker's, once vLLM mixed this class in

    def r3rl_load_weights(self, payload: bytes) -> dict[str, Any]:
        """Load the safetensors blob ``payload`` (checkpoint names) into the served model; returns
        ``{"tensors", "path", "seconds"}`` (``path``: ``reload_weights`` or ``load_weights``)."""
        from safetensors.torch import load

        t0 = time.perf_counter()
        weights = load(payload)
        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            path = "reload_weights"
            repacked = _rerun_experts_processing(runner.model)
        else:
            runner.model.load_weights(weights=iter(weights.items()))
            path = "load_weights"
            repacked = 0
        return {"tensors": len(weights), "path": path, "experts_reprocessed": repacked, "seconds": time.perf_counter() - t0}

    def r3rl_delete_rollouts(self, rollout_ids: list[str]) -> list[str]:
        """Retention for a local store (``local_store_dir``), whose root this worker's writer
        owns (its lock refuses any other writer, a deleting trainer included): delete
        ``rollout_ids`` through that writer's store; returns those it held. Store nodes delete
        over HTTP instead (``r3rdma delete``, :func:`r3rdma.store.retention.delete_rollout`).

        Reaches the plug-in's recorder (``model_runner._r3``): the plug-in has no public call
        for this yet. Workers that do not record (tensor-parallel ranks > 0) return []."""
        from r3rdma.errors import UnknownRolloutError

        recorder = getattr(self.model_runner, "_r3", None)
        capturer = getattr(recorder, "capturer", None)
        if recorder is None or capturer is None:
            return []
        recorder.flush()  # nothing of these rollouts still queued behind the delete
        store = capturer.sink.store  # the writer's store (the plug-in's sink passes attributes to its writer)
        deleted = []
        for rollout_id in rollout_ids:
            try:
                store.delete_rollout(rollout_id)
            except UnknownRolloutError:
                continue
            deleted.append(rollout_id)
        return deleted


def _rerun_experts_processing(model: Any) -> int:
    """Re-run each MoE layer's experts-kernel weight processing after an in-place reload; returns
    the layers it ran on.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs
    ``moe_kernel.fused_experts.process_weights_after_loading(layer)`` on the first load only
    ("Setup moe kernel only on the first call"), so a reload leaves the experts' weights in the
    checkpoint's layout where that step re-lays them out: vLLM's CPU experts prepack them for
    their grouped GEMM, and a reloaded CPU engine computed wrong expert outputs (measured: an
    identity reload changed the probe's top log-probability from -2.19 to -0.77). The values are
    copied back into the parameters the engine holds (their storage, which compiled code and CUDA
    graphs captured), as vLLM's reload does for its own processing. Experts kernels that do not
    override the step (the base class's no-op, e.g. Triton's) are skipped."""
    import torch

    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:  # a release without the modular kernel's experts classes
        return 0
    base = getattr(FusedMoEExperts, "process_weights_after_loading", None)
    count = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        step = getattr(type(experts), "process_weights_after_loading", None)
        if experts is None or step is None or step is base:
            continue
        held = {n: p for n, p in module.named_parameters(recurse=False)}
        experts.process_weights_after_loading(module)
        with torch.no_grad():
            for name, old in held.items():
                new = getattr(module, name, None)
                if new is None or new is old:
                    continue
                if new.shape == old.shape and new.dtype == old.dtype:
                    old.data.copy_(new.data)
                    setattr(module, name, old)  # keep the storage the engine captured
        count += 1
    return count


def checkpoint_state_dict(model: Any) -> dict[str, Any]:
    """``model``'s state dict under the checkpoint's names (what ``save_pretrained`` writes):
    transformers 5 fuses experts at load time, and vLLM's loader takes the checkpoint's layout."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: the state dict is the checkpoint's
        return state
    return dict(revert_weight_conversion(model, state))


def push_weights(llm: Any, model: Any, *, dtype: Any = None) -> dict[str, Any]:
    """Send ``model``'s weights (a transformers model) into every worker of ``llm`` and return
    the first worker's answer plus ``bytes`` and ``seconds`` (serialise, send, load).

    ``dtype``: cast floating tensors to it before sending (the engine's dtype halves the bytes
    of a bf16 engine; vLLM's loader casts anyway). Call ``llm.reset_prefix_cache()`` after it:
    cached KV was computed by the old weights."""
    from safetensors.torch import save

    t0 = time.perf_counter()
    tensors = {}
    for name, t in checkpoint_state_dict(model).items():
        t = t.to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    payload = save(tensors)
    del tensors
    answers = llm.collective_rpc("r3rl_load_weights", args=(payload,))
    answer = dict(answers[0]) if answers else {}
    answer["bytes"] = len(payload)
    answer["seconds"] = time.perf_counter() - t0
    answer["workers"] = len(answers)
    return answer
