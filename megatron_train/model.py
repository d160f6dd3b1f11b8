"""The model as the train loop sees it: megatron-core DDP-wrapped chunks, initialised."""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_train.config import ExperimentConfig
from megatron_train.init import initialize_weights, mark_tensor_parallel_weights
from megatron_train.runtime import Runtime
from models.llama import build_model_chunks, transformer_config
from models.specs import transformer_engine_available


def use_transformer_engine(cfg: ExperimentConfig) -> bool:
    """Resolve ``model.transformer_impl`` against what this machine has."""
    impl = cfg.model.transformer_impl
    if impl == "auto":
        return transformer_engine_available()
    if impl == "transformer_engine" and not transformer_engine_available():
        raise RuntimeError(
            "model.transformer_impl=transformer_engine but Transformer Engine or CUDA is missing; "
            "install the 'gpu' extra on a GPU node or set model.transformer_impl=local"
        )
    return impl == "transformer_engine"


def build_model(cfg: ExperimentConfig, rt: Runtime) -> list[DistributedDataParallel]:
    """Build, initialise and DDP-wrap this rank's model chunks."""
    te = use_transformer_engine(cfg)
    config = transformer_config(cfg, rt.dtype, te)
    chunks = build_model_chunks(cfg, config, te)
    for chunk in chunks:
        chunk.to(rt.device)
    initialize_weights(chunks, cfg.train.seed, cfg.model.init_method_std, cfg.model.num_layers)
    mark_tensor_parallel_weights(chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.ddp.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.ddp.overlap_grad_reduce,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
        use_distributed_optimizer=cfg.optimizer.distributed,
        bucket_size=cfg.ddp.bucket_size,
    )
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # Only the first chunk buckets, as in Megatron-LM: later chunks' grads are ready late.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(chunks)
    ]
    return wrapped
