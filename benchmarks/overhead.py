"""Framework overhead: our training step against a bare megatron-core loop, same model and layout.

    python benchmarks/overhead.py [--nproc 8] [--steps 20] [--config configs/demo.yaml] [k=v ...]

Relaunches itself under torchrun. Each rank times the same number of steps for
(a) megatron-train's loop (real data loader, loss all-reduce and broadcast, NaN checks) and
(b) a loop written directly against megatron-core (GPTModel, DDP, distributed optimizer,
get_forward_backward_func) on one pre-built in-memory batch. Prints ms/step and the overhead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from torchrun_self import check_config, relaunch

from megatron_train import cli


def _time_steps(step_fn, steps: int, warmup: int = 2) -> list[float]:
    import torch

    times = []
    for i in range(warmup + steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        step_fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _ours(cfg, rt, steps: int) -> list[float]:

    from megatron_train.data import batch_iterator, build_datasets
    from megatron_train.model import build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.step import Stepper

    model = build_model(cfg, rt)
    optimizer, scheduler = build_optimizer(cfg, model, rt.dtype)
    stepper = Stepper(cfg, model, optimizer, scheduler, rt.device)
    train_ds, _ = build_datasets(cfg, str(Path(cfg.logging.run_dir) / "data_cache"))
    iters = [batch_iterator(train_ds, 0, cfg) for _ in model]
    return _time_steps(lambda: stepper.train_step(iters), steps)


def _bare(cfg, rt, steps: int) -> list[float]:
    """The same step written directly against megatron-core, as its examples do."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_train.model import use_transformer_engine
    from megatron_train.models.decoder import transformer_config
    from megatron_train.models.specs import decoder_block_spec

    te = use_transformer_engine(cfg)
    config = transformer_config(cfg, rt.dtype, te)
    vpp = config.virtual_pipeline_model_parallel_size
    model = []
    for i, vp in enumerate(range(vpp) if vpp else [None]):
        gpt = GPTModel(
            config=config, transformer_layer_spec=decoder_block_spec(config, te, vp),
            vocab_size=cfg.model.padded_vocab_size, max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            position_embedding_type="rope", rotary_base=cfg.model.rotary_base, vp_stage=vp,
        ).to(rt.device)  # fmt: skip
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model.append(DistributedDataParallel(config, ddp_config, gpt, disable_bucketing=i > 0))
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.optimizer.lr,
        bf16=rt.dtype == torch.bfloat16,
        params_dtype=rt.dtype,
        use_distributed_optimizer=True,
        clip_grad=cfg.optimizer.clip_grad,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    t, s = cfg.train, cfg.data.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, s), device=rt.device)
    positions = torch.arange(s, device=rt.device).expand(t.micro_batch_size, s)

    def loss_func(output):
        loss = output.float().sum()
        return (
            loss,
            torch.tensor(output.numel(), dtype=torch.int, device=rt.device),
            {"lm loss": loss.detach()},
        )

    def forward_step(_, m):
        return m(tokens, positions, attention_mask=None, labels=tokens), loss_func

    nmb = t.global_batch_size // (t.micro_batch_size * parallel_state.get_data_parallel_world_size())
    schedule = get_forward_backward_func()

    def step():
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(forward_step_func=forward_step, data_iterator=[None] * len(model) if vpp else None,
                 model=model if vpp else model[0], num_microbatches=nmb, seq_length=s,
                 micro_batch_size=t.micro_batch_size, forward_only=False)  # fmt: skip
        optimizer.step()

    return _time_steps(step, steps)


def worker(args) -> None:
    import torch

    from megatron_train import runtime
    from megatron_train.resolve import resolve

    env = runtime.launch_env()
    cfg = resolve(args.config, args.overrides, env.world_size)
    rt = runtime.initialize(cfg, env)
    bare = _bare(cfg, rt, args.steps)
    ours = _ours(cfg, rt, args.steps)
    if rt.is_main:
        b, o = statistics.median(bare), statistics.median(ours)
        print(f"layout TP={cfg.parallel.tensor} PP={cfg.parallel.pipeline} world={rt.world_size} "
              f"device={rt.device.type} dtype={rt.dtype} steps={args.steps} (median)")  # fmt: skip
        print(f"bare megatron-core : {b * 1000:8.1f} ms/step")
        print(f"megatron-train     : {o * 1000:8.1f} ms/step")
        print(f"overhead           : {100 * (o - b) / b:+8.1f} %")
    torch.distributed.barrier()
    runtime.shutdown()


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--nproc", type=cli.positive_int, default=8)
    parser.add_argument("--steps", type=cli.positive_int, default=20)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if code := check_config(args.config, args.overrides, args.nproc):
        return code
    return relaunch(
        __file__, args.nproc, [f"--steps={args.steps}", f"--config={args.config}", *args.overrides]
    )


if __name__ == "__main__":
    sys.exit(main())
