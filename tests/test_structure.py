"""The shape of the code: families behind one registry, derived sizes on the config, imports that
only point down the layers, and the loop's cadences decided in their components (no torchrun)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from megatron_train.checkpoint.policy import SavePolicy
from megatron_train.config import ConfigError, ModelConfig
from megatron_train.errors import ConversionError
from megatron_train.evaluation import validation_due
from megatron_train.metrics import MetricsLogger
from megatron_train.models import registry
from megatron_train.resolve import build_config
from tests.conftest import ROOT

# Lowest first; a module may import from its own layer or a lower one, never a higher one.
LAYERS = [
    ["errors", "json_text", "cudnn_sharing", "optional_imports", "config", "config_loading", "config_checks",
     "megatron_compat", "cpu_compat", "tokenizer", "text_sources", "sentencepiece_cuts", "text_encoding",
     "token_writer", "checkpoint.files", "checkpoint.safe_load", "checkpoint.results_server",
     "hf.model_dir", "hf.safetensors_io", "outputs", "run_lock", "eager_fusions", "data_cache", "placement",
     "host_memory", "rendezvous", "parent_death"],
    ["models.*"],
    ["inputs", "resolve", "hf.plan"],
    ["runtime", "init", "model", "optim", "memory", "moe_stats"],
    ["data", "batch", "step", "metrics", "stopping", "evaluation", "shared_folders", "profiling",
     "gc_pacing"],
    ["checkpoint.state", "checkpoint.policy", "checkpoint.streaming_save", "checkpoint.manager"],
    ["hf.convert", "inference", "warm_start"],
    ["train", "preflight", "cli", "torchrun"],
]  # fmt: skip


def _modules() -> dict[str, ast.Module]:
    found = {}
    for root, prefix in ((ROOT / "megatron_train", ""), (ROOT / "models", "models.")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = prefix + ".".join(p for p in parts if p != "__init__")
            found[name.rstrip(".") or "__init__"] = ast.parse(path.read_text())
    return found


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_train"):
            base = node.module.removeprefix("megatron_train").lstrip(".")
            names.update(f"{base}.{a.name}".lstrip(".") for a in node.names)
            names.add(base)
        elif isinstance(node, ast.Import):
            names.update(
                a.name.removeprefix("megatron_train.")
                for a in node.names
                if a.name.startswith("megatron_train.")
            )
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {dep for dep in _imports(tree) if dep in modules and dep != name}
        for name, tree in modules.items()
    }


def _layer(name: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if name in layer or (name.startswith("models.") and "models.*" in layer):
            return index
    return None


def test_imports_form_no_cycle():
    graph, state = _graph(), {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in graph[node]:
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, node, dep])}"
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_imports_only_point_down_the_layers():
    upward = []
    for name, deps in _graph().items():
        if _layer(name) is None:
            assert name in ("__init__", "models", "checkpoint", "hf"), (
                f"{name} is in no layer: add it to LAYERS"
            )
            continue
        upward += [f"{name} -> {dep}" for dep in deps if (_layer(dep) or 0) > _layer(name)]
    assert not upward
    assert _imports(_modules()["config"]) <= {"errors", "errors.ConfigError", "errors.shown"}


def test_the_families_import_from_a_checkout_without_an_editable_install():
    # A wheel install (the air-gapped wheelhouse) run from the repository root imports this
    # checkout's megatron_train, whose families sit outside it in models/.
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
        f"sys.path.insert(0, {str(ROOT)!r}); import megatron_train.models.registry as r; print(r.__file__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(ROOT / "models" / "registry.py")


def test_derived_sizes_are_computed_on_the_config_only():
    m = ModelConfig(hidden_size=4096, num_attention_heads=32, num_query_groups=8, vocab_size=128256)
    assert (m.head_dim, m.query_groups, m.padded_vocab_size) == (128, 8, 128256)
    assert ModelConfig(num_attention_heads=4, kv_channels=48).head_dim == 48
    sources = [p.read_text() for p in (ROOT / "megatron_train").rglob("*.py")]
    sources += [p.read_text() for p in (ROOT / "models").rglob("*.py")]
    assert sum(s.count("hidden_size // ") for s in sources) == 1
    assert sum(s.count("num_query_groups or ") for s in sources) == 1


def test_registry_maps_presets_and_hf_architectures_to_their_family():
    for family in registry.FAMILIES.values():
        for name in family.presets:
            assert registry.preset(name)[0] is family
            assert build_config({"model": {"preset": name}}).model.family == family.name
        for arch in family.hf_architectures:
            assert registry.for_hf({"architectures": [arch]}) is family
    with pytest.raises(ConversionError, match="unsupported architecture"):
        registry.for_hf({"architectures": ["GPT2LMHeadModel"]})
    for raw, key, problem in [
        ({"model": {"preset": "llama5"}}, "model.preset", "unknown preset 'llama5'"),
        ({"model": {"family": "gpt2"}}, "model.family", "unknown family 'gpt2'"),
        ({"model": {"family": "gpt2", "preset": "tiny"}}, "model.family", "unknown family 'gpt2'"),
        ({"model": {"family": ["llama"], "preset": "tiny"}}, "model.family", "unknown family ['llama']"),
        ({"model": {"family": "qwen3", "preset": "tiny"}}, "model.family", "tiny' belongs to 'llama'"),
        (
            {"model": {"preset": "qwen3-moe-tiny", "num_experts": None}},
            "model.num_experts",
            "preset 'qwen3-moe-tiny' is a mixture of experts",
        ),
    ]:
        with pytest.raises(ConfigError) as info:
            build_config(raw)
        assert info.value.key == key and problem in info.value.problem


@pytest.mark.parametrize(
    "preset, published",
    [
        ("llama2-7b", 6_738_415_616),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("qwen3-0.6b", 596_049_920),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("mixtral-8x7b", 46_702_792_704),
    ],
)
def test_parameter_counts_match_the_published_models(preset, published):
    m = build_config({"model": {"preset": preset}}).model
    assert registry.family_of(m).parameters(m).total(m.num_layers) == published


def test_save_policy_decides_every_reason_to_save():
    policy = SavePolicy(every_steps=3, every_minutes=1.0, at_end=True, last_step=10)
    assert [s for s in range(1, 11) if policy.reason(s, 0.0, False)] == [3, 6, 9, 10]
    assert policy.reason(4, 0.0, stopping=True) == "stop"
    assert policy.reason(4, 59.9, False) is None and policy.reason(4, 60.0, False) == "minute interval"
    policy.saved(60.0)
    assert policy.reason(5, 119.0, False) is None and policy.reason(5, 120.0, False) == "minute interval"
    quiet = SavePolicy(every_steps=0, every_minutes=0.0, at_end=False, last_step=10)
    assert not any(quiet.reason(s, 1e6, False) for s in range(1, 11))


def test_validation_and_log_cadence(tmp_path):
    cfg = build_config({"train": {"steps": 7, "eval_interval": 3}, "logging": {"log_interval": 2}})
    assert [s for s in range(1, 8) if validation_due(cfg, s)] == [3, 6, 7]
    cfg.train.eval_interval = 0
    assert not any(validation_due(cfg, s) for s in range(1, 8))
    cfg.model.vocab_size = 256
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(0)
    log.start_interval()
    for step in range(1, 8):
        log.after_step(step, tokens=step * 512, loss=1.0, lr=1e-3, grad_norm=0.5, skipped=0)
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6, 7]
