"""Bad configs fail fast with one message naming the key and a fix, and exit code 2."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_train.config import WEIGHT_SHAPING_KEYS, ConfigError, ModelConfig, to_dict
from megatron_train.config_loading import apply_overrides, read_yaml
from megatron_train.resolve import at_layout, load_config, resolve, validate
from megatron_train.train import main
from tests.conftest import ROOT, run_tool, write_config


@pytest.fixture
def good_config(tmp_path, corpus):
    return write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")


def test_good_config_loads_and_validates(good_config):
    cfg = load_config(good_config, ["parallel.tensor=2", "optimizer.lr=2e-4"])
    validate(cfg, world_size=4)
    assert cfg.parallel.tensor == 2 and cfg.optimizer.lr == 2e-4
    assert cfg.model.num_layers == 4, "preset values fill unset keys"
    # Only context parallelism needs the sequence cut into 2 x CP chunks.
    validate(load_config(good_config, ["data.seq_length=63"]), world_size=1)
    validate(load_config(good_config, ["data.seq_length=60", "parallel.context=2"]), world_size=2)


def test_numbers_written_as_exponents_without_a_dot_are_numbers(tmp_path, good_config):
    """YAML 1.1 (PyYAML's) reads ``1e-3`` as text: a blend's weight would be a dataset's name."""
    text = good_config.read_text()
    assert "\ntrain:\n" in text
    config = tmp_path / "exponents.yaml"
    config.write_text(text.replace("\ntrain:\n", "\ntrain:\n  exit_after_minutes: 5e2\n"))
    cfg = load_config(config, ["data.blend=[3e-1, /data/a, 7E-1, /data/b]", "optimizer.lr=.5e-3"])
    assert cfg.data.blend == [0.3, "/data/a", 0.7, "/data/b"]
    assert (cfg.train.exit_after_minutes, cfg.optimizer.lr) == (500.0, 0.0005)
    # megatron-core divides each weight by their sum
    with pytest.raises(ConfigError, match=r"weights as large as 1e\+308 add up past the largest float"):
        validate(load_config(good_config, ["data.blend=[1e308, /data/a, 1e308, /data/b]"]), world_size=1)


def test_a_name_yaml_would_read_as_a_date_is_text_and_one_it_reads_as_a_number_is_told_to_quote(
    tmp_path, good_config
):
    dated = tmp_path / "dated.yaml"
    dated.write_text("logging:\n  run_dir: 2024-06-01\n")
    assert read_yaml(dated) == {"logging": {"run_dir": "2024-06-01"}}
    cfg = load_config(good_config, ["logging.run_dir=2024-06-01", "data.blend=[1, 2024-06-01, 2, /data/b]"])
    assert cfg.logging.run_dir == "2024-06-01" and cfg.data.blend == [1, "2024-06-01", 2, "/data/b"]
    for value, reads in [("123", "YAML reads 123 as a number"), ("off", "as truth values")]:
        with pytest.raises(ConfigError) as info:
            load_config(good_config, [f"logging.run_dir={value}"])
        assert info.value.fix.startswith("quote it to keep it text") and reads in info.value.fix
    assert load_config(good_config, ['logging.run_dir="123"']).logging.run_dir == "123"


def test_the_weight_shaping_keys_are_model_options():
    # An architecture mismatch reads each of them from both configs.
    assert set(WEIGHT_SHAPING_KEYS) <= {f.name for f in dataclasses.fields(ModelConfig)}


BAD_INPUTS = [
    # (overrides, world size, key named in the error)
    (["model.num_layer=3"], 1, "model.num_layer"),
    # an override with an empty name is malformed, not an unknown key ''
    (["=5"], 1, "=5"),
    (["model..num_layers=3"], 1, "model..num_layers=3"),
    (["train.steps=ten"], 1, "train.steps"),
    (["parallel.tensor=3"], 8, "parallel.tensor"),
    (
        ["parallel.tensor=8", "model.num_query_groups=8", "model.num_attention_heads=12"],
        8,
        "model.num_attention_heads",
    ),
    (["parallel.pipeline=3"], 3, "model.num_layers"),
    (["parallel.pipeline=4", "parallel.virtual_pipeline=4"], 4, "model.num_layers"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2"], 2, "parallel.virtual_pipeline"),
    (["train.global_batch_size=6"], 4, "train.global_batch_size"),
    (["data.seq_length=512"], 1, "data.seq_length"),
    (["data.blend=[/nonexistent/prefix]"], 1, "data.blend"),
    (["data.tokenizer.path=/nonexistent/spm.model"], 1, "data.tokenizer.path"),
    (["model.transformer_impl=fast"], 1, "model.transformer_impl"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel"),
    (["optimizer.warmup_steps=100"], 1, "optimizer.warmup_steps"),
    (["data.valid_blend=[]", "data.split=98,2,0"], 1, "data.valid_blend"),
    (["data.valid_blend=[/nonexistent/valid]"], 1, "data.split"),  # the good config cuts a split
    # a split with no valid or test part overrides the file's split: the next check is reached
    (["data.valid_blend=[/nonexistent/valid]", "data.split=100,0,0"], 1, "data.valid_blend"),
    # the decay ends at optimizer.decay_steps, not train.steps: warmup and WSD's phase fit before it
    (["optimizer.warmup_steps=3", "optimizer.decay_steps=3"], 1, "optimizer.warmup_steps"),
    (
        [
            "optimizer.decay_style=WSD",
            "optimizer.decay_steps=4",
            "optimizer.wsd_decay_steps=4",
            "optimizer.warmup_steps=1",
        ],
        1,
        "optimizer.wsd_decay_steps",
    ),  # fmt: skip
    (["model.preset=llama9"], 1, "model.preset"),
    (["model.family=gpt2"], 1, "model.family"),
    (["model.recompute=selective", "model.recompute_modules=[attention]"], 1, "model.recompute_modules"),
    (["model.recompute=selective", "model.recompute_modules=[]"], 1, "model.recompute_modules"),
    # megatron-core skips a dense MLP's recompute in an expert layer; expert modules need experts
    (
        ["model.preset=qwen3-moe-tiny", "model.recompute=selective", "model.recompute_modules=[mlp]"],
        1,
        "model.recompute_modules",
    ),
    (["model.recompute=selective", "model.recompute_modules=[moe]"], 1, "model.recompute_modules"),
    (
        [
            "model.preset=qwen3-moe-tiny",
            "model.recompute=selective",
            "model.recompute_modules=[shared_experts]",
        ],
        1,
        "model.recompute_modules",
    ),
    (
        [
            "model.preset=qwen3-moe-tiny",
            "model.moe_shared_expert_ffn_hidden_size=64",
            "model.recompute=selective",
            "model.recompute_modules=[moe,shared_experts]",
        ],
        1,
        "model.recompute_modules",
    ),
    (
        ["model.recompute=full", "model.recompute_num_layers=3", "parallel.pipeline=2"],
        2,
        "model.recompute_num_layers",
    ),
    (["model.recompute=everything"], 1, "model.recompute"),
    # torch.compile cannot trace expert routing or megatron-core's partial-layer recompute
    (["model.preset=qwen3-moe-tiny", "model.compile=true"], 1, "model.compile"),
    (
        ["model.compile=true", "model.recompute=selective", "model.recompute_modules=[core_attn,layernorm]"],
        1,
        "model.compile",
    ),
    (["ddp.overlap_param_gather=true", "optimizer.distributed=false"], 1, "ddp.overlap_param_gather"),
    (
        ["checkpoint.optimizer_format=dp_reshardable", "optimizer.distributed=false"],
        1,
        "checkpoint.optimizer_format",
    ),
    (["parallel.context=4", "data.seq_length=60"], 4, "data.seq_length"),
    (["parallel.context=3"], 2, "parallel.context"),
    (["parallel.pipeline=2"], 3, "parallel.pipeline"),
    (
        [
            "parallel.context=2",
            "parallel.tensor=4",
            "parallel.sequence_parallel=true",
            "data.seq_length=20",
            "model.num_query_groups=4",
        ],
        8,
        "data.seq_length",
    ),
    # tensor parallelism splits an MLP's width: megatron asserted it at build, in a traceback
    (["parallel.tensor=2", "model.ffn_hidden_size=353"], 2, "model.ffn_hidden_size"),
    (
        ["model.preset=qwen3-moe-tiny", "parallel.tensor=2", "model.moe_shared_expert_ffn_hidden_size=33"],
        2,
        "model.moe_shared_expert_ffn_hidden_size",
    ),
    (["data.reset_position_ids=true"], 1, "data.reset_position_ids"),
    # a long-context model that would train with unscaled RoPE
    (["model.rope_scaling_factor=4"], 1, "model.rope_scaling_factor"),
    (["data.document_mask=maybe"], 1, "data.document_mask"),
    # the test config trains 6 steps
    (["profile.num_steps=3"], 1, "profile.num_steps"),
    (["profile.start_step=5", "profile.num_steps=3"], 1, "profile.start_step"),
    (["profile.start_step=2", "profile.num_steps=7"], 1, "profile.num_steps"),
    (["profile.start_step=2", "profile.ranks=[2]"], 2, "profile.ranks"),
    (["profile.start_step=2", "profile.ranks=[0,0]"], 2, "profile.ranks"),
    (["profile.start_step=2", "profile.ranks=[]"], 1, "profile.ranks"),
]


@pytest.mark.parametrize(
    ("overrides", "world_size", "key"), BAD_INPUTS, ids=[b[2] + str(i) for i, b in enumerate(BAD_INPUTS)]
)
def test_bad_config_names_key_and_exits_2(good_config, monkeypatch, capsys, overrides, world_size, key):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert main(["--config", str(good_config), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"'{key}'" in err and "Fix:" in err, err


def test_a_profile_longer_than_the_run_is_told_what_fits_after_its_start(good_config, monkeypatch, capsys):
    """The fix said "at most 6" (train.steps) for a profile starting at step 5, which the next
    start refused again as running past the last step."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--config", str(good_config), "profile.start_step=5", "profile.num_steps=100"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: config error at 'profile.num_steps': 100 exceeds train.steps=6. Fix: set it to at most 2 "
        "(steps 5-6)"
    )


def test_missing_config_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "'--config'" in capsys.readouterr().err


def test_unknown_key_suggests_the_close_one(good_config):
    with pytest.raises(ConfigError) as info:
        load_config(good_config, ["optimizer.warmup_step=3"])
    assert info.value.key == "optimizer.warmup_step" and "optimizer.warmup_steps" in info.value.fix


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        # An option of another section, even where the own section has a near name (data.split).
        ("data.steps=5", "did you mean 'train.steps'?"),
        ("lr=1e-3", "did you mean 'optimizer.lr'?"),
        ("model.seed=1", "did you mean 'train.seed'?"),
        # Megatron-LM's arguments, as a YAML key or as the flag's own spelling.
        (
            "parallel.tensor_model_parallel_size=2",
            "Megatron-LM's --tensor-model-parallel-size is 'parallel.tensor'",
        ),
        ("train-iters=10", "Megatron-LM's --train-iters is 'train.steps' here"),
        ("bf16=true", "Megatron-LM's --bf16 is 'train.precision' here"),
        ("data.tokenizer.kind=x", "valid keys: ['type', 'path']"),
        ("optimizer.LR=1e-3", "did you mean 'optimizer.lr'?"),
    ],
)
def test_unknown_key_names_the_option_it_is_elsewhere(good_config, override, hint):
    with pytest.raises(ConfigError) as info:
        load_config(good_config, [override])
    assert info.value.key == override.partition("=")[0] and hint in info.value.fix, info.value


@pytest.mark.parametrize(
    ("yaml_text", "override", "key", "fix"),
    [
        ("train:\n  steps: 5\n", "train.steps.x=1", "train.steps", "write train.steps=VALUE"),
        ("model: 5\n", "model.preset=tiny", "model", "write it as key: value pairs"),
    ],
)
def test_an_override_into_a_value_that_is_no_section_says_how_to_write_it(
    tmp_path, yaml_text, override, key, fix
):
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(config, [override])
    assert (info.value.key, info.value.fix) == (key, fix)


@pytest.mark.parametrize(
    ("override", "key", "missing"),
    [
        ("data.blend=[data/nothing]", "data.blend", "data/nothing.bin"),
        ("data.tokenizer.path=tok/nothing.model", "data.tokenizer.path", "'tok/nothing.model'"),
        ("checkpoint.init_from=ckpt/nothing", "checkpoint.init_from", "'ckpt/nothing'"),
    ],
)
def test_a_relative_path_that_is_missing_names_the_directory_it_was_looked_for_in(
    good_config, tmp_path, monkeypatch, override, key, missing
):
    """A job started from another folder reads the config's relative paths from there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve(good_config, [override], world_size=1)
    assert info.value.key == key
    assert info.value.problem == f"{missing} does not exist under {tmp_path}, the current directory"


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("logging.run_dir=runs/a #2", "runs/a #2"),
        ("model.preset=#tiny", "#tiny"),
        ("data.blend=[runs/a #1, runs/b]", ["runs/a #1", "runs/b"]),
        ('logging.run_dir="runs/a #2"', "runs/a #2"),
    ],
)
def test_a_hash_in_an_override_is_part_of_its_value_not_a_comment(good_config, override, value):
    """The shell has taken any comment off the command line: YAML's reading of ' #' as one made
    logging.run_dir='runs/a #2' train in runs/a, another run's folder."""
    raw = read_yaml(good_config)
    key = override.partition("=")[0].split(".")
    node = apply_overrides(raw, [override])
    for part in key:
        node = node[part]
    assert node == value


@pytest.mark.parametrize(
    ("text", "value"), [("0042", 42), ("010", 10), ("08", 8), ("-007", -7), ("0x10", 16)]
)
def test_a_number_with_leading_zeros_is_decimal_in_a_file_and_an_override(tmp_path, text, value):
    """YAML 1.1 reads 0042 as octal (34) and 08 as text; YAML 1.2, and anyone writing a seed, decimal."""
    config = tmp_path / "c.yaml"
    config.write_text(f"train:\n  seed: {text}\n")
    assert read_yaml(config)["train"]["seed"] == value
    assert apply_overrides({}, [f"train.seed={text}"])["train"]["seed"] == value


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig"])
def test_a_config_saved_as_utf16_or_with_a_byte_order_mark_reads_as_utf8(tmp_path, encoding):
    """Windows PowerShell's ">" writes UTF-16 with a byte-order mark, which was refused as unreadable."""
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 7\nlogging:\n  run_dir: runs/é\n", encoding=encoding)
    assert read_yaml(config) == {"train": {"steps": 7}, "logging": {"run_dir": "runs/é"}}


@pytest.mark.parametrize(
    "override", ['logging.run_dir="runs/x', "data.blend=[runs/a, runs/b", 'logging.run_dir="a" b']
)
def test_an_override_with_a_quote_or_bracket_left_open_is_refused_not_taken_as_text(good_config, override):
    """Taken as text, logging.run_dir="runs/x (its closing quote lost) made a folder named '"runs'."""
    with pytest.raises(ConfigError) as info:
        load_config(good_config, [override])
    assert info.value.key == override.partition("=")[0]
    assert (
        "is not valid YAML" in info.value.problem
        and info.value.fix == "close the quote or bracket, with nothing after it"
    )


def test_one_dataset_where_a_list_is_wanted_is_shown_as_the_list(good_config):
    with pytest.raises(ConfigError) as info:
        load_config(good_config, ["data.blend=data/web"])
    assert info.value.fix == "write a YAML list: data.blend=[data/web] as an override"


def test_a_hash_after_a_number_is_refused_not_dropped(good_config):
    with pytest.raises(ConfigError) as info:
        load_config(good_config, ["optimizer.lr=1e-3 # the usual"])
    assert info.value.key == "optimizer.lr" and "'1e-3 # the usual'" in info.value.problem


def test_cli_exit_code_is_2_before_any_heavy_work(good_config):
    result = run_tool(
        "-m", "megatron_train.train", "--config", str(good_config), "parallel.tensor=3", check=False
    )
    assert result.returncode == 2
    assert "parallel.tensor" in result.stderr and "Traceback" not in result.stderr


def test_a_cuda_torch_on_a_machine_without_gpu_adds_no_line_to_an_error():
    """A login node with a CUDA build of torch: importing its extension builder logs that no CUDA
    runtime was found (seen with torch 2.11+cu130), a line above every one-line error."""
    import logging

    import megatron_train  # noqa: F401  (sets the filter)

    def kept(message: str) -> bool:
        record = logging.LogRecord("torch.utils.cpp_extension", logging.WARNING, "", 0, message, (), None)
        return bool(logging.getLogger("torch.utils.cpp_extension").filter(record))

    assert not kept("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
    assert kept("Error checking compiler version for c++")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.num_layers % (cfg.parallel.pipeline * (cfg.parallel.virtual_pipeline or 1)) == 0


def test_init_from_an_hf_model_sets_the_architecture_and_refuses_conflicts(good_config, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    start = [f"checkpoint.init_from={hf}", "model.preset=null"]
    cfg = load_config(good_config, start)
    validate(cfg, world_size=1)
    assert (cfg.model.num_layers, cfg.model.ffn_hidden_size, cfg.model.norm_eps) == (2, 160, 1e-6)
    # A longer context than the model was made for: the limit is no weight of a RoPE model.
    longer = load_config(good_config, [*start, "model.max_position_embeddings=512", "data.seq_length=256"])
    validate(longer, world_size=1)
    assert (longer.model.max_position_embeddings, longer.model.num_layers) == (512, 2)
    for overrides, key in [
        ([f"checkpoint.init_from={hf}"], "model.preset"),
        ([*start, "model.hidden_size=128"], "model.hidden_size"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(good_config, overrides)
        assert info.value.key == key
    for overrides in ([*start, "checkpoint.load=none"], ["checkpoint.init_from=/nonexistent"]):
        with pytest.raises(ConfigError) as info:
            validate(load_config(good_config, overrides), world_size=1)
        assert info.value.key == "checkpoint.init_from"
    # A model whose vocabulary the run's tokenizer outgrows: its config.json fixes the vocabulary,
    # so the fix is that model's tokenizer, not removing a model.vocab_size nobody wrote.
    small = tmp_path / "small"
    config.vocab_size = 64
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(small)
    with pytest.raises(ConfigError) as info:
        resolve(good_config, [f"checkpoint.init_from={small}", "model.preset=null"], world_size=1)
    assert info.value.key == "data.tokenizer.path" and "more than the 64 of the Hugging Face model" in str(
        info.value
    )
    assert f"data.tokenizer.type=huggingface data.tokenizer.path={small}" in info.value.fix


def test_transformer_engine_demanded_where_it_cannot_run_is_one_line(good_config):
    te = "model.transformer_impl=transformer_engine"
    result = run_tool("-m", "megatron_train.train", "--config", str(good_config), te, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'model.transformer_impl'" in errors[0] and "no CUDA device" in errors[0]
    assert "Traceback" not in result.stderr


def test_paths_a_user_writes_are_not_expanded_but_a_recorded_one_still_loads(good_config):
    """No shell reads a config: '~/runs' would be a folder named '~'. A checkpoint's recorded
    config is read back as it was written, whatever it holds."""
    with pytest.raises(ConfigError, match=r"'~/runs/x' holds a ~ or \$VARIABLE") as err:
        load_config(good_config, ["logging.run_dir=~/runs/x"])
    assert err.value.key == "logging.run_dir"
    cfg = load_config(good_config, [])
    saved = to_dict(dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir="~/runs/x")))
    assert at_layout(saved, tensor=1, pipeline=1).logging.run_dir == "~/runs/x"


def test_a_range_error_writes_integer_bounds_whole(good_config):
    with pytest.raises(ConfigError) as err:
        load_config(good_config, ["train.seed=-1"])
    assert err.value.fix == "set train.seed to a value >= 0 and <= 4294967295"


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        # The range names what is wanted; the 64-bit bound would offer a value the range refuses.
        (f"train.seed={10**20}", "set train.seed to a value >= 0 and <= 4294967295"),
        (f"parallel.tensor={-(10**20)}", "set parallel.tensor to a value >= 1"),
        (f"train.steps={10**20}", "set train.steps to at most 9,223,372,036,854,775,807"),
    ],
)
def test_an_integer_past_64_bits_is_told_the_fields_range(good_config, override, fix):
    with pytest.raises(ConfigError) as err:
        load_config(good_config, [override])
    assert err.value.fix == fix


def test_inference_leaves_rope_uncompiled_whatever_training_did(good_config):
    """Generation has no KV cache: every token is a new sequence length, which a compiled RoPE
    would recompile for until torch gives up with a warning (seen with tools/generate.py)."""
    saved = to_dict(load_config(good_config, ["model.rope_fusion=true"]))
    assert saved["model"]["rope_fusion"] is True
    assert at_layout(saved, tensor=1, pipeline=1).model.rope_fusion is False


def test_inference_runs_where_the_checkpoint_was_not_trained(good_config):
    """A GPU config's checkpoint (Transformer Engine demanded, cuDNN attention) is sampled from on
    a machine without either, such as this one, where training with them is refused."""
    from megatron_train.model import check_attention_backend, layer_implementation, transformer_engine_missing

    gpu = ["model.transformer_impl=transformer_engine", "model.attention_backend=cudnn"]
    saved = to_dict(load_config(good_config, gpu))
    if transformer_engine_missing() is not None:  # a machine with TE trains with it
        with pytest.raises(ConfigError):
            layer_implementation(load_config(good_config, gpu))
    cfg = at_layout(saved, tensor=1, pipeline=1)
    check_attention_backend(cfg)
    assert "model.transformer_impl=auto" in layer_implementation(cfg)[1]


LOADER_WORKERS_ON_ONE_CORE = """
import os, sys
from megatron_train.config import ConfigError
from megatron_train.data import check_loader_workers
from megatron_train.resolve import load_config

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
check_loader_workers(load_config(sys.argv[1], []))  # the default's two workers
try:
    check_loader_workers(load_config(sys.argv[1], ["data.num_workers=3"]))
except ConfigError as err:
    print(err.key, "|", err.fix)
"""


def test_loader_workers_beyond_the_cores_a_rank_may_run_on(good_config):
    """A process pinned to one core (as Slurm's --cpus-per-task=1 pins a rank): the default's two
    workers still pass, as they always ran there; three are refused, naming the bound."""
    result = run_tool("-c", LOADER_WORKERS_ON_ONE_CORE, str(good_config), check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        result.stdout.strip()
        == "data.num_workers | set data.num_workers to at most 2 (0 reads in the rank's own process)"
    )
