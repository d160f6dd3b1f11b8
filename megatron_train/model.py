"""The model as the train loop sees it: the family's megatron-core model chunks, initialised and
DDP-wrapped, with Transformer Engine layers where the machine has them."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

from megatron_train.config import ExperimentConfig
from megatron_train.errors import ConfigError
from megatron_train.init import initialize_weights
from megatron_train.megatron_compat import (
    compile_rotary_embedding,
    compiled_layers_without_warnings,
    linears_outside_compiled_graphs,
    mark_tensor_parallel_weights,
    moe_aux_loss_over_split_sequences,
    moe_router_without_transformer_engine,
    moe_split_sizes_on_cpu,
    recompute_without_transformer_engine,
)
from megatron_train.models.registry import family_of
from megatron_train.runtime import Runtime, compute_dtype


def transformer_engine_missing() -> str | None:
    """Why Transformer Engine cannot be used here (no CUDA, or its import error), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        return f"it does not import ({err})"
    return None


def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports and a GPU is present."""
    return transformer_engine_missing() is None


def layer_implementation(cfg: ExperimentConfig) -> tuple[bool, str]:
    """Whether to use Transformer Engine layers, and why, for the log."""
    impl, missing = cfg.model.transformer_impl, transformer_engine_missing()
    if impl == "local":
        return False, "local layers (model.transformer_impl=local)"
    if missing is None:
        return True, f"Transformer Engine layers (model.transformer_impl={impl})"
    if impl == "transformer_engine":
        raise ConfigError(
            "model.transformer_impl",
            f"is transformer_engine but Transformer Engine cannot be used: {missing}",
            "install the 'gpu' extra on a GPU node (README: Versions) or set model.transformer_impl=local",
        )
    return False, f"local layers (model.transformer_impl=auto: Transformer Engine unusable, {missing})"


def check_attention_backend(cfg: ExperimentConfig) -> None:
    """Refuse an SDPA kernel this machine cannot run for the model, which SDPA would only find in the
    first forward step ("No available kernel"): PyTorch has cuDNN and memory-efficient attention
    only on CUDA; its flash kernel has no dropout on the CPU and takes no mask on CUDA; its CUDA
    flash and cuDNN kernels take no fp32."""
    backend, cuda = cfg.model.attention_backend, torch.cuda.is_available()
    if backend in ("cudnn", "efficient") and not cuda:
        raise ConfigError(
            "model.attention_backend",
            f"is {backend}, a kernel PyTorch has only on CUDA, and there is no CUDA device",
            "use auto, flash or math here",
        )
    if cuda and backend in ("flash", "cudnn") and compute_dtype(cfg) == torch.float32:
        raise ConfigError(
            "model.attention_backend",
            f"is {backend}, whose CUDA kernel runs in bf16 or fp16 only, and the model computes in fp32 "
            "(train.precision)",
            "set train.precision=bf16, or model.attention_backend to auto, efficient or math",
        )
    if backend != "flash":
        return
    if not cuda and cfg.model.attention_dropout > 0:
        raise ConfigError(
            "model.attention_dropout",
            f"is {cfg.model.attention_dropout}, and PyTorch's flash attention has no dropout on the CPU "
            "(model.attention_backend=flash)",
            "set model.attention_backend to auto or math, or model.attention_dropout=0",
        )
    if cuda and cfg.data.document_mask:
        raise ConfigError(
            "data.document_mask",
            "gives attention a mask, which PyTorch's flash attention does not take on CUDA "
            "(model.attention_backend=flash)",
            "set model.attention_backend to auto, efficient or cudnn, or data.document_mask=false",
        )


def compiles_rope(cfg: ExperimentConfig, te: bool) -> bool:
    """Whether ``model.rope_fusion`` compiles RoPE on its own: on the local layers (TE's fuse it)
    that are not compiled whole (``model.compile``)."""
    return cfg.model.rope_fusion and not te and not cfg.model.compile


def use_transformer_engine(cfg: ExperimentConfig) -> bool:
    """Resolve ``model.transformer_impl`` against what this machine has."""
    return layer_implementation(cfg)[0]


def build_chunks(cfg: ExperimentConfig, rt: Runtime) -> list[torch.nn.Module]:
    """This rank's model chunks on its device, not initialised and not wrapped."""
    family, te = family_of(cfg.model), use_transformer_engine(cfg)
    if not te:
        check_attention_backend(cfg)
    recompute_without_transformer_engine()
    compile_rotary_embedding(compiles_rope(cfg, te))
    moe_router_without_transformer_engine()
    moe_split_sizes_on_cpu()
    moe_aux_loss_over_split_sequences()
    chunks = family.build_model_chunks(cfg, family.transformer_config(cfg, rt.dtype, te), te)
    for chunk in chunks:
        chunk.to(rt.device)
    return chunks


def _experts_in_their_own_optimizer(model_chunks: list[torch.nn.Module]) -> None:
    """Mark routed experts' weights as expert-parallel (``allreduce = False``) at EP1 too.

    megatron-core does so only when EP > 1; the distributed optimizer then gives them an optimizer
    of their own in its chain, and a checkpoint's optimizer state holds one entry per chained
    optimizer. Marking them at EP1 as well keeps that structure the same at every EP size, so a
    checkpoint resumes across EP1 <-> EP > 1. Their gradients are then reduced over the
    expert-data-parallel group, which at EP1 is the data-parallel group itself.
    """
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, (SequentialMLP, TEGroupedMLP)):
                for param in module.parameters():
                    param.allreduce = False


def aligns_param_gather(cfg: ExperimentConfig) -> bool:
    """Whether the interleaved schedule launches the parameter all-gathers of all pipeline stages
    together (Megatron-LM's default ``align_param_gather`` when overlapping them under VPP)."""
    overlapped = cfg.ddp.overlap_param_gather and cfg.optimizer.distributed
    return overlapped and (cfg.parallel.virtual_pipeline or 1) > 1


def _check_documents_on_transformer_engine(cfg: ExperimentConfig) -> None:
    """Transformer Engine masks documents through one packed sequence per micro-batch."""
    if not cfg.data.document_mask:
        return
    if cfg.parallel.context > 1:
        raise ConfigError(
            "data.document_mask",
            "with parallel.context > 1 runs on our local attention only (Transformer Engine's packed "
            "sequences would need every document padded to a multiple of 2 x parallel.context)",
            "set model.transformer_impl=local, parallel.context=1 or data.document_mask=false",
        )
    if cfg.train.micro_batch_size > 1:
        raise ConfigError(
            "train.micro_batch_size",
            f"is {cfg.train.micro_batch_size}, but Transformer Engine's document masking packs one sample "
            "per micro-batch (as Megatron-LM does)",
            "set train.micro_batch_size=1 or model.transformer_impl=local",
        )


def _check_compile_on_transformer_engine(cfg: ExperimentConfig) -> None:
    if cfg.model.compile:
        raise ConfigError(
            "model.compile",
            "compiles the local layers, and this run uses Transformer Engine's, which fuse their own kernels",
            "set model.transformer_impl=local or model.compile=false",
        )


def _compile_layers(chunks: list[torch.nn.Module]) -> None:
    """torch.compile each transformer layer in place: its parameters and state_dict keys stay as
    they are, so checkpoints do not change."""
    compiled_layers_without_warnings()
    linears_outside_compiled_graphs(chunks[0].config.gradient_accumulation_fusion)
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            layer.compile()


def build_model(cfg: ExperimentConfig, rt: Runtime) -> list[DistributedDataParallel]:
    """Build, initialise and DDP-wrap this rank's model chunks."""
    if use_transformer_engine(cfg):
        _check_documents_on_transformer_engine(cfg)
        _check_compile_on_transformer_engine(cfg)
    chunks = build_chunks(cfg, rt)
    initialize_weights(chunks, family_of(cfg.model), cfg.model, cfg.train.seed)
    if cfg.model.compile:
        _compile_layers(chunks)
    mark_tensor_parallel_weights(chunks)
    _experts_in_their_own_optimizer(chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.ddp.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.ddp.overlap_grad_reduce,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
        align_param_gather=aligns_param_gather(cfg),
        use_distributed_optimizer=cfg.optimizer.distributed,
        bucket_size=cfg.ddp.bucket_size,
    )
    return [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            # Only the first chunk buckets, as in Megatron-LM: later chunks' grads are ready late.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(chunks)
    ]
