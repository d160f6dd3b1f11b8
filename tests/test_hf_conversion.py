"""Hugging Face <-> megatron-train conversion, checked against transformers itself.

Tiny random models are built with transformers (no download) for each supported family, imported
with the CLI at TP2 x PP2, run by our model at four TP x PP layouts, mixtures of experts also at
EP2 and TP2 x PP2 x EP2 (imported checkpoints are layout-independent, like every checkpoint of
ours), and compared logit by logit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import (
    ROOT,
    load_tool,
    run_tool,
    single_rank,
    torchrun,
    torchrun_env,
    train_losses,
    write_config,
)
from safetensors.torch import load_file, save_file

from megatron_train.hf.model_dir import read_hf_config
from megatron_train.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

# One xdist worker runs this module, so its module-scoped models and imports are built once.
pytestmark = pytest.mark.xdist_group("hf_conversion")

# The import below writes TP2 x PP2: logits at that layout, and merged back onto one rank. The
# resharding between is megatron-core's; each layout here costs a launch of its ranks.
LAYOUTS = [(1, 1), (2, 2)]
_COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
FAMILIES = {
    # Llama 3.1: RoPE scaling, GQA, untied embeddings.
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),  # fmt: skip
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
    # Qwen2: QKV biases and tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    # Llama 2: full multi-head attention (as many KV heads as query heads), RoPE theta 10000.
    "llama2": lambda: transformers.LlamaConfig(**{**_COMMON, "num_key_value_heads": 4}),
    # Qwen3: QK-norm, and a head dimension other than hidden / heads.
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32),
    # Qwen3-MoE: 4 experts, 2 per token, weights renormalised over the chosen ones.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
    ),  # fmt: skip
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
}
MOE = ("qwen3_moe", "mixtral")
# (TP, PP, EP) for the mixtures of experts, whose experts split over EP ranks too: each expert's
# weights over TP, the experts over EP, each stage's layers numbered from its first.
MOE_LAYOUTS = [(2, 2, 2)]


def convert(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_tool("tools/convert_checkpoint.py", *args, check=check)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    models = {}
    for i, (name, make_config) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(make_config()).float().eval()
        # Random init leaves biases at zero and norms at one; make them count.
        for layer in model.model.layers:
            if name == "qwen2":
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
            if name.startswith("qwen3"):
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
        model.save_pretrained(root / name)
        (root / name / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
        models[name] = root / name
    return models


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("imported")
    for name, path in hf_models.items():
        result = convert("import-hf", "--hf", str(path), "--out", str(root / name), "--tp", "2", "--pp", "2")
        assert result.stderr == "", result.stderr  # no library warning above the one result line
    return {name: root / name for name in hf_models}


@pytest.mark.slow
def test_logits_match_transformers_at_every_layout(tmp_path, hf_models, imported):
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    references = {}
    for name, path in hf_models.items():
        with torch.no_grad():
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            references[name] = model(tokens).logits
    runs = [(tp, pp, 1, imported) for tp, pp in LAYOUTS]
    runs += [(tp, pp, ep, {name: imported[name] for name in MOE}) for tp, pp, ep in MOE_LAYOUTS]
    for tp, pp, ep, ckpts in runs:
        nproc = tp * pp * ep
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
             "tests/helpers/logits_worker.py", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--tokens",
             str(tmp_path / "tokens.pt"), "--out", str(tmp_path / "logits.pt"), *map(str, ckpts.values())],
            cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        ours = torch.load(tmp_path / "logits.pt")
        for name, ckpt in ckpts.items():
            diff = (ours[str(ckpt)] - references[name]).abs().max().item()
            assert diff <= 1e-4, f"{name} at TP{tp} x PP{pp} x EP{ep}: max |diff| {diff}"


@pytest.mark.slow
def test_hf_to_ours_to_hf_is_bitwise_identical(tmp_path, hf_models, imported):
    for name, path in hf_models.items():
        back = tmp_path / f"{name}-back"
        convert("export-hf", "--ckpt", str(imported[name]), "--out", str(back))
        original, exported = load_file(path / "model.safetensors"), load_file(back / "model.safetensors")
        assert sorted(original) == sorted(exported), name
        for key, tensor in original.items():
            assert tensor.dtype == exported[key].dtype and torch.equal(tensor, exported[key]), (name, key)
        for side in ("config.json", "generation_config.json", "tokenizer_config.json"):
            assert (path / side).read_bytes() == (back / side).read_bytes(), (name, side)


def test_a_config_json_without_architectures_is_read_by_its_model_type(tmp_path, hf_models):
    """As transformers' AutoModelForCausalLM does for a config saved on its own; Qwen2, a variant
    of the Llama family told apart only by its architecture, keeps its biases through a round trip."""
    for name, path in hf_models.items():
        config = json.loads((path / "config.json").read_text())
        architectures = config.pop("architectures")
        bare = tmp_path / name
        shutil.copytree(path, bare)
        (bare / "config.json").write_text(json.dumps(config))
        assert read_hf_config(bare)["architectures"] == architectures, name
    convert("import-hf", "--hf", str(tmp_path / "qwen2"), "--out", str(tmp_path / "imported"))
    convert("export-hf", "--ckpt", str(tmp_path / "imported"), "--out", str(tmp_path / "back"))
    original = load_file(hf_models["qwen2"] / "model.safetensors")
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(exported) and any(key.endswith("q_proj.bias") for key in exported)
    assert all(torch.equal(tensor, exported[key]) for key, tensor in original.items())


def test_stored_tensors_the_model_does_not_take_are_named(tmp_path, hf_models):
    """As transformers names the weights it leaves out; RoPE's stored inverse frequencies are not
    weights and pass without a word."""
    llama = tmp_path / "llama"
    shutil.copytree(hf_models["llama"], llama)
    weights = load_file(llama / "model.safetensors")
    extra = {
        "model.vision_tower.proj.weight": torch.ones(4),
        "model.layers.0.mlp.down_proj.bias": torch.ones(64),
    }
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file({**weights, **extra, **inv_freq}, llama / "model.safetensors")
    result = convert("import-hf", "--hf", str(llama), "--out", str(tmp_path / "imported"))
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "note: 2 tensor(s)" in notes[0], result.stdout
    assert all(name in notes[0] for name in extra) and "inv_freq" not in notes[0]


@pytest.mark.slow
def test_export_shards_large_models_and_transformers_loads_them(tmp_path, hf_models, imported):
    back = tmp_path / "back"
    convert("export-hf", "--ckpt", str(imported["llama"]), "--out", str(back), "--max-shard-gib", "0.0001")
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    for (key, a), b in zip(original.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), key
    # A shard size past every float is one file.
    whole = tmp_path / "whole"
    convert("export-hf", "--ckpt", str(imported["llama"]), "--out", str(whole), "--max-shard-gib", "1e300")
    assert sorted(p.name for p in whole.glob("*.safetensors")) == ["model.safetensors"]


@pytest.mark.parametrize(("temperature", "drawn"), [(1e-320, {1}), (1e308, {0, 1, 2, 3})])
def test_sampling_takes_any_positive_temperature(temperature, drawn):
    """A temperature near 0 draws the most likely token, a huge one draws every token alike;
    dividing the raw logits by 1e-320 sent them all to infinity, whose softmax is nan."""
    next_token = load_tool("tools/generate.py").next_token
    logits = torch.tensor([2.0, 5.0, 1.0, 4.9], dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    assert {next_token(logits, 1.0, temperature, gen) for _ in range(200)} == drawn


@pytest.mark.slow
def test_greedy_generation_matches_transformers_at_tp2(hf_models, imported):
    """Launched as README shows; the ranks say a bad input once and add nothing to a good run."""

    def generate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2",
             "tools/generate.py", "--ckpt", str(imported["qwen2"]), *args],
            cwd=ROOT, env=env or torchrun_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    result = generate("--tp", "2", "--prompt-ids", "5,7,9", "--max-new-tokens", "8")
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr[-3000:]
    # Without OMP_NUM_THREADS, which torchrun then sets with a banner of its own.
    unset = {k: v for k, v in torchrun_env().items() if k != "OMP_NUM_THREADS"}
    bad = generate("--tp", "2", "--prompt-ids", "5,x", env=unset)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: config error at '--prompt-ids': '5,x' is not a list of integers. Fix: write ids like 1,42,7"
    ], bad.stderr[-3000:]
    ours = [int(i) for i in result.stdout.split("ids:")[1].split()[0].split(",")]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["qwen2"], dtype=torch.float32)
    theirs = model.generate(torch.tensor([[5, 7, 9]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert ours == theirs


@pytest.mark.slow
def test_trained_checkpoint_exports_and_generates_text_in_transformers(tmp_path, corpus, trained):
    out = tmp_path / "hf"
    convert("export-hf", "--ckpt", str(trained["save_dir"]), "--out", str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    prompt = tokenizer("def main(", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(generated[0][prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    # 4 steps of training mostly predict indentation: text, if not interesting text.
    assert prompt["input_ids"].shape[1] < generated.shape[1] <= prompt["input_ids"].shape[1] + 12 and text
    ours = load_tokenizer("sentencepiece", str(corpus["tokenizer"])).tokenize("def main(")
    assert tokenizer("def main(", add_special_tokens=False)["input_ids"] == list(ours)
    sampled = run_tool(
        "tools/generate.py", "--ckpt", str(trained["save_dir"]), "--prompt", "def main(",
        "--top-p", "0.9", "--max-new-tokens", "8",
    )  # fmt: skip
    assert (
        sampled.stdout.count("ids:") == 1 and len(sampled.stdout.split("ids:")[1].split()[0].split(",")) == 8
    )

    # Imported back, the model's tokenizer is the exported HF one; the run's SentencePiece model,
    # named with its type, gives the same tokens.
    imported = tmp_path / "imported"
    convert("import-hf", "--hf", str(out), "--out", str(imported))
    greedy = ["tools/generate.py", "--ckpt", str(imported), "--prompt", "def main(", "--max-new-tokens", "6"]
    with_hf = run_tool(*greedy)
    with_spm = run_tool(*greedy, "--tokenizer", str(corpus["tokenizer"]), "--tokenizer-type", "sentencepiece")
    assert with_hf.stdout.startswith("ids: ") and with_spm.stdout == with_hf.stdout


@pytest.mark.slow
def test_qkv_biases_with_a_sentencepiece_tokenizer_export_as_llama_with_zero_output_biases(
    tmp_path, corpus, expect_error
):
    """In a Qwen2ForCausalLM directory, transformers' AutoTokenizer always builds Qwen2's byte-level
    BPE, which splits text otherwise than the run's SentencePiece model: such a model exports as
    LlamaForCausalLM with attention biases, the output projection's zero. transformers computes
    our logits from it and reads the run's tokens; it imports back and exports bitwise the same;
    an output-projection bias that is not zero is refused on import."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", model={"qkv_bias": True},
                          train={"steps": 3, "eval_interval": 0})  # fmt: skip
    result = single_rank(config)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "hf"
    convert("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(out), "--dtype", "float32")
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"] and hf_config["attention_bias"] is True
    weights = load_file(out / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.bias"].count_nonzero() > 0, "3 steps trained the biases"
    layers, hidden = hf_config["num_hidden_layers"], hf_config["hidden_size"]
    assert all(not weights[f"model.layers.{i}.self_attn.o_proj.bias"].count_nonzero() for i in range(layers))

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer("sentencepiece", str(corpus["tokenizer"])).tokenize("def main(x):\n    return x")
    assert tokenizer("def main(x):\n    return x", add_special_tokens=False)["input_ids"] == list(ours)
    tokens = torch.tensor([list(ours)])
    torch.save(tokens, tmp_path / "tokens.pt")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "tests/helpers/logits_worker.py", "--tp", "1", "--pp", "1", "--tokens", str(tmp_path / "tokens.pt"),
         "--out", str(tmp_path / "logits.pt"), str(tmp_path / "run")],
        cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        theirs = model(tokens).logits
    diff = (torch.load(tmp_path / "logits.pt")[str(tmp_path / "run")] - theirs).abs().max().item()
    assert diff <= 1e-4, diff

    convert("import-hf", "--hf", str(out), "--out", str(tmp_path / "imported"))
    convert("export-hf", "--ckpt", str(tmp_path / "imported"), "--out", str(tmp_path / "again"))
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(weights) and all(torch.equal(again[k], weights[k]) for k in weights)

    biased = tmp_path / "biased"
    shutil.copytree(out, biased)
    save_file({**weights, "model.layers.2.self_attn.o_proj.bias": torch.full((hidden,), 0.01)},
              biased / "model.safetensors")  # fmt: skip
    expect_error("import-hf", "--hf", str(biased), "--out", str(tmp_path / "refused"),
                 needle="'model.layers.2.self_attn.o_proj.bias' in", out=tmp_path / "refused")  # fmt: skip


@pytest.fixture
def expect_error(capsys):
    """The converter's ``main`` in this process, as the bad-input catalogue runs it (a process
    each took 4 s of a 2-core machine; the catalogue tests each command's exit in a process)."""

    def expect(*args: str, needle: str, out=None) -> None:
        capsys.readouterr()
        code = load_tool("tools/convert_checkpoint.py").main(list(args))
        err = capsys.readouterr().err
        assert code == 2, err[-2000:]
        assert needle in err and len(err.strip().splitlines()) == 1, err[-2000:]
        if out is not None:
            assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))

    return expect


def test_bad_inputs_are_clear_errors_and_leave_nothing_behind(tmp_path, hf_models, trained, expect_error):
    llama = hf_models["llama"]
    out = tmp_path / "out"
    expect_error("import-hf", "--hf", str(llama), "--out", str(out), "--tp", "3",
                 needle="TP3 x PP1 does not fit this model: 4 heads", out=out)  # fmt: skip
    expect_error(
        "import-hf", "--hf", str(tmp_path / "nowhere"), "--out", str(out), needle="does not exist", out=out
    )

    def variant(name: str, edit_config=None, edit_weights=None):
        d = tmp_path / name
        d.mkdir()
        config = json.loads((llama / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
        weights = load_file(llama / "model.safetensors")
        save_file(edit_weights(weights) if edit_weights else weights, d / "model.safetensors")
        return d

    gpt2 = variant("gpt2", edit_config=lambda c: {**c, "architectures": ["GPT2LMHeadModel"]})
    expect_error(
        "import-hf", "--hf", str(gpt2), "--out", str(out), needle="unsupported architecture", out=out
    )
    half = variant("half", edit_config=lambda c: {**c, "dtype": "bfloat16"})
    expect_error("import-hf", "--hf", str(half), "--out", str(out), needle="declares dtype bfloat16", out=out)
    torn = variant("torn", edit_weights=lambda w: {k: v for k, v in w.items() if "layers.1.mlp" not in k})
    expect_error("import-hf", "--hf", str(torn), "--out", str(out), needle="model.layers.1.mlp", out=out)
    # A damaged tensor is found only while the checkpoint is being written, inside DCP's save.
    damaged = variant(
        "damaged", edit_weights=lambda w: {**w, "model.norm.weight": w["model.norm.weight"] / 0}
    )
    expect_error(
        "import-hf", "--hf", str(damaged), "--out", str(out), needle="'model.norm.weight' in", out=out
    )
    bigvocab = variant("bigvocab")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(400)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(bigvocab)
    expect_error("import-hf", "--hf", str(bigvocab), "--out", str(out), needle="has 400 tokens", out=out)

    sparse = tmp_path / "sparse"
    shutil.copytree(hf_models["qwen3_moe"], sparse)
    moe_config = json.loads((sparse / "config.json").read_text())
    (sparse / "config.json").write_text(json.dumps({**moe_config, "decoder_sparse_step": 2}))
    expect_error("import-hf", "--hf", str(sparse), "--out", str(out), needle="decoder_sparse_step=2", out=out)

    out.mkdir()
    expect_error("import-hf", "--hf", str(llama), "--out", str(out), needle="already exists")
    assert list(out.iterdir()) == []
    expect_error(
        "export-hf", "--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "x"), needle="does not exist"
    )
    exported = tmp_path / "exported"
    expect_error("export-hf", "--ckpt", str(trained["save_dir"]), "--out", str(exported),
                 "--tokenizer", str(tmp_path / "moved.model"), needle="moved.model' does not exist",
                 out=exported)  # fmt: skip


@pytest.mark.slow
def test_training_starts_from_an_hf_directory_then_resumes_from_its_own_checkpoints(tmp_path, corpus):
    torch.manual_seed(3)
    hf_config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": 1024, "max_position_embeddings": 128})
    hf = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(hf_config).float().save_pretrained(hf)
    convert("import-hf", "--hf", str(hf), "--out", str(tmp_path / "imported"))
    same_model = {"preset": None, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 160,
                  "num_attention_heads": 4, "num_query_groups": 2, "norm_eps": 1e-6}  # fmt: skip
    runs = {
        # The architecture comes from config.json; TP2 slices the HF tensors directly.
        "direct": (2, {"preset": None}, hf, ["parallel.tensor=2"]),
        "imported": (1, same_model, tmp_path / "imported", []),
    }
    losses = {}
    for name, (nproc, model, init_from, overrides) in runs.items():
        config = write_config(
            tmp_path / f"{name}.yaml", corpus, tmp_path / name, model=model,
            checkpoint={"init_from": str(init_from)}, train={"steps": 3},
        )  # fmt: skip
        result = torchrun(nproc, config, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"starting from checkpoint.init_from={init_from}" in result.stdout
        losses[name] = train_losses(tmp_path / name)
    assert len(losses["direct"]) == 3
    assert max(abs(a - b) for a, b in zip(losses["direct"], losses["imported"])) < 1e-4

    resumed = torchrun(2, tmp_path / "direct.yaml", "parallel.tensor=2", "train.steps=5")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "starting from checkpoint.init_from" not in resumed.stdout
    assert (
        train_losses(tmp_path / "direct")[:3] == losses["direct"]
        and len(train_losses(tmp_path / "direct")) == 5
    )


@pytest.mark.parametrize(
    ("family", "option", "needle"),
    [
        ("qwen3", {"moe_router_score_function": "sigmoid"}, "routes with softmax"),
        ("qwen3", {"moe_shared_expert_ffn_hidden_size": 64}, "no shared expert"),
        (
            "mixtral",
            {"moe_router_expert_bias": True, "moe_router_score_function": "sigmoid"},
            "routes with softmax",
        ),
    ],
)
def test_moe_options_transformers_cannot_express_are_refused_on_export(family, option, needle):
    from megatron_train.config import ModelConfig
    from megatron_train.errors import ConversionError
    from megatron_train.models import registry

    m = ModelConfig(family=family, num_experts=4, qk_norm=family == "qwen3", vocab_size=300, **option)
    with pytest.raises(ConversionError, match=needle):
        registry.family_of(m).hf_configs(m, torch.float32, {})


def test_attention_dropout_travels_with_the_model_and_a_run_may_choose_its_own(tmp_path):
    """config.json's attention_dropout is the imported model's, and an export writes ours; a run
    starting from the directory takes it unless its config sets model.attention_dropout (dropout
    is a training choice, not part of the weights)."""
    from megatron_train import resolve
    from models.hf_config import common_fields

    hf = {**FAMILIES["qwen2"]().to_dict(), "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.1}
    assert resolve.hf_model_options(hf)["attention_dropout"] == 0.1
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"")
    init = {"checkpoint": {"init_from": str(tmp_path)}}
    assert resolve.build_config(init).model.attention_dropout == 0.1
    assert common_fields(resolve.build_config(init).model, {})["attention_dropout"] == 0.1
    own = resolve.build_config({**init, "model": {"attention_dropout": 0.0}})
    assert own.model.attention_dropout == 0.0
    assert common_fields(own.model, {})["attention_dropout"] == 0.0


@pytest.mark.parametrize(
    ("family", "field", "value", "says"),
    [
        ("llama", "num_hidden_layers", 0, "num_hidden_layers: 0 is out of range (megatron-train's "
         "model.num_layers: a value >= 1)"),
        ("llama", "rms_norm_eps", -1e-5, "rms_norm_eps: -1e-05 is out of range (megatron-train's "
         "model.norm_eps: a value > 0)"),
        ("llama2", "num_key_value_heads", 3, "num_key_value_heads: 4 heads are not divisible into 3 "
         "query groups"),
        ("qwen3", "head_dim", -32, "head_dim: -32 is out of range (megatron-train's model.kv_channels"),
        ("qwen3_moe", "num_experts_per_tok", 0, "num_experts_per_tok: 0 is out of range "
         "(megatron-train's model.moe_router_topk"),
        ("qwen2", "attention_dropout", 1.5, "attention_dropout: 1.5 is out of range (megatron-train's "
         "model.attention_dropout"),
    ],
)  # fmt: skip
def test_config_json_values_no_model_takes_name_the_config_json_field(tmp_path, family, field, value, says):
    """A config.json our model cannot be built from is its fault, in its own words: the refusal
    names its field (not a model.* key the user never wrote) and says to correct or fetch it again,
    for an import and for a run starting from it (checkpoint.init_from) alike."""
    from megatron_train import resolve
    from megatron_train.errors import ConfigError, ConversionError

    # config.json as save_pretrained writes it: the config and the model class's name.
    model_class = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).__class__.__name__
    good = {**FAMILIES[family]().to_dict(), "architectures": [model_class]}
    assert resolve.hf_model_options(good)["num_layers"] == 2
    with pytest.raises(ConversionError) as refused:
        resolve.hf_model_options({**good, field: value})
    assert str(refused.value).startswith(f"config.json {says}"), refused.value
    assert str(refused.value).endswith(
        "; it describes no model this framework can build: correct config.json, or download the model again"
    )
    # A run starting from such a directory: the same words, under checkpoint.init_from, one fix.
    (tmp_path / "config.json").write_text(json.dumps({**good, field: value}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as run:
        resolve.build_config({"checkpoint": {"init_from": str(tmp_path)}})
    assert run.value.key == "checkpoint.init_from" and f"config.json {says}" in str(run.value)
    assert str(run.value).count("Fix:") == 1, run.value
