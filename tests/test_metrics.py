"""FLOPs and MFU accounting, and the records a start keeps."""

import json
import subprocess
import sys
import time

import pytest
import torch
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_train.data import TimedBatches, slowest_wait
from megatron_train.metrics import MetricsLogger, flops_per_token, peak_tflops
from megatron_train.resolve import build_config
from tests.conftest import ROOT, torchrun_env, write_config


def test_flops_per_token_counts_causal_attention_half_for_llama3_8b_at_8k():
    cfg = build_config({"model": {"preset": "llama3-8b"}, "data": {"seq_length": 8192}})
    # By hand, per layer: QKV 2*4096*(4096+2*1024) = 50,331,648; output 2*4096*4096 = 33,554,432;
    # SwiGLU 6*4096*14336 = 352,321,536; attention over the causal half 2*8192*4096 = 67,108,864.
    # 32 layers plus the output layer 2*4096*128256, times 3 for forward and backward.
    per_layer = 50_331_648 + 33_554_432 + 352_321_536 + 67_108_864
    assert flops_per_token(cfg) == 3 * (32 * per_layer + 2 * 4096 * 128256) == 51_470_401_536


def test_flops_per_token_of_a_mixture_of_experts_counts_the_active_experts_only():
    cfg = build_config({"model": {"preset": "qwen3-30b-a3b"}, "data": {"seq_length": 4096}})
    # By hand, per layer: QKV 2*2048*(4096+2*512) = 20,971,520; output 2*4096*2048 = 16,777,216;
    # 8 of 128 experts 8*6*2048*768 = 75,497,472; router 2*2048*128 = 524,288; attention over the
    # causal half 2*4096*4096 = 33,554,432. 48 layers plus the output layer 2*2048*151936, times 3.
    per_layer = 20_971_520 + 16_777_216 + 75_497_472 + 524_288 + 33_554_432
    assert flops_per_token(cfg) == 3 * (48 * per_layer + 2 * 2048 * 151936) == 23_081_779_200


@pytest.mark.parametrize(("start", "kept"), [(2, [1, 2]), (0, [])])
def test_a_start_drops_the_records_of_the_steps_it_redoes(tmp_path, start, kept):
    """A resume redoes the steps after its checkpoint; a fresh start (a run requeued after a crash
    before its first save) redoes them all."""
    cfg = build_config({"train": {"steps": 4}, "model": {"vocab_size": 256}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(start)
    log.close()
    assert [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == kept


def test_a_start_drops_the_lines_that_hold_no_record_of_ours(tmp_path):
    """A line torn by a kill, or edited by hand into other JSON or bytes that are not UTF-8, is
    dropped, not a traceback."""
    cfg = build_config({"train": {"steps": 4}, "model": {"vocab_size": 256}})
    lines = ['{"step": 1}', '{"step": 2, "lo', "[1]", "5", '{"step": "x"}', "[" * 100_000, '{"step": 2}']
    (tmp_path / "metrics.jsonl").write_bytes("".join(line + "\n" for line in lines).encode() + b"\xff\xfe\n")
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(2)
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_time_left_out_of_an_interval_does_not_shrink_its_step_time(monkeypatch):
    """Validation after step 2 of a 4-step log interval (train.eval_interval not a multiple of
    logging.log_interval): the steps' own 1 s each is reported, where restarting the interval's
    clock after validation reported 0.5 s (twice the tokens/s)."""
    cfg = build_config({"train": {"steps": 8}, "model": {"vocab_size": 256}, "logging": {"log_interval": 4}})
    clock = [0.0]
    monkeypatch.setattr("megatron_train.metrics.time.perf_counter", lambda: clock[0])
    log = MetricsLogger(cfg, None, enabled=False, world_size=1)
    reported = []
    monkeypatch.setattr(log, "log_train", lambda step, *args: reported.append((step, args[4])))
    log.start_interval()
    for step in range(1, 9):
        clock[0] += 1.0
        log.after_step(step, 0, loss=1.0, lr=1.0, grad_norm=1.0, skipped=0)
        if step in (2, 4):
            with log.left_out():
                clock[0] += 30.0
            log.log_validation(step, 1.0)
    assert reported == [(4, 1.0), (8, 1.0)]


def test_wandb_offline_run_receives_every_record_of_metrics_jsonl(tmp_path):
    """logging.wandb: one offline wandb run in <run_dir>/wandb holding each value the interval and
    validation records hold (the run file stores each as its JSON text)."""
    cfg = build_config({"train": {"steps": 2}, "model": {"vocab_size": 256}, "logging": {"wandb": True}})
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(0)
    log.log_train(1, tokens=4096, loss=7.125, lr=1.5e-4, grad_norm=0.8125, step_time=0.25, skipped=0)
    log.log_validation(1, val_loss=6.9375)
    log.log_train(2, tokens=8192, loss=6.5, lr=3e-4, grad_norm=0.6875, step_time=0.5, skipped=1)
    log.close()
    # finish() can return before wandb's service has written the records out (CI saw a file holding
    # only its header); teardown waits for the service to close its files, as the atexit hook of a
    # training process does.
    wandb.teardown()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    stored = runs[0].read_bytes()
    for record in records:
        for key, value in record.items():
            # wandb writes a whole float as an integer: 8192.0 as 8192.
            text = json.dumps(int(value) if isinstance(value, float) and value.is_integer() else value)
            assert key.encode() in stored and text.encode() in stored, (key, value)


def test_tensorboard_receives_every_record_and_a_resume_hides_the_steps_it_redoes(tmp_path):
    """logging.tensorboard: each value of the interval and validation records as a scalar in
    <run_dir>/tensorboard; a start from step 2 hides the first start's step 3, as TensorBoard shows
    the event files together."""
    cfg = build_config(
        {"train": {"steps": 4}, "model": {"vocab_size": 256}, "logging": {"tensorboard": True}}
    )
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(0)
    for step in (1, 2, 3):
        log.log_train(
            step, tokens=4096 * step, loss=10.0 - step, lr=1e-4, grad_norm=0.5, step_time=0.25, skipped=0
        )
    log.log_validation(2, val_loss=9.5)
    log.close()
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(2)
    for step in (3, 4):
        log.log_train(
            step, tokens=4096 * step, loss=5.0 - step, lr=2e-4, grad_norm=0.5, step_time=0.5, skipped=1
        )
    log.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    shown = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert shown["train/loss"] == [(1, 9.0), (2, 8.0), (3, 2.0), (4, 1.0)]
    assert shown["train/consumed_tokens"] == [(1, 4096), (2, 8192), (3, 12288), (4, 16384)]
    assert shown["validation/val_loss"] == [(2, 9.5)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        group = "validation" if "val_loss" in record else "train"
        for key, value in record.items():
            if key != "step":
                assert (record["step"], pytest.approx(value)) in shown[f"{group}/{key}"], key


@pytest.mark.slow
def test_a_wandb_server_out_of_reach_stops_every_rank_in_one_line_and_leaves_the_run_files(tmp_path, corpus):
    """wandb.init on rank 0 fails after its timeout; the other ranks, already past every check,
    must not wait for it in the first step, and the run's own files stay as they were."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the config of an earlier start\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    config = write_config(
        tmp_path / "cfg.yaml", corpus, run_dir, logging={"wandb": True, "wandb_mode": "online"}
    )
    env = {
        **torchrun_env(),
        "WANDB_API_KEY": "0" * 40,  # well-formed, so the start gets as far as wandb.init
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # the discard port: nothing listens
        "WANDB_INIT_TIMEOUT": "1",
    }
    launch = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2",
              "-m", "megatron_train.train", "--config", str(config)]  # fmt: skip
    result = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "'logging.wandb': wandb could not start its online run" in errors[0], errors
    assert [line for line in result.stderr.splitlines() if line.strip()] == errors, result.stderr[-3000:]
    assert (run_dir / "config.yaml").read_text() == "the config of an earlier start\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert not (run_dir / "wandb").exists()


def test_the_line_shows_data_wait_once_it_is_a_twentieth_of_the_step(tmp_path, capsys):
    cfg = build_config({"train": {"steps": 4}, "model": {"vocab_size": 256}})
    log = MetricsLogger(cfg, tmp_path, enabled=True, world_size=1)
    log.open(0)
    log.log_train(1, tokens=1, loss=1.0, lr=1.0, grad_norm=1.0, step_time=0.5, skipped=0, data_wait=0.2)
    log.log_train(2, tokens=2, loss=1.0, lr=1.0, grad_norm=1.0, step_time=0.5, skipped=0, data_wait=0.02)
    log.close()
    first, second = capsys.readouterr().out.splitlines()
    assert "| 500 ms/step | data wait 40% |" in first and "data wait" not in second
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_wait_s"] for r in records] == [0.2, 0.02]


def _wait_on_rank(rank: int, store: str, waits: list) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def slow():
        while True:
            time.sleep(0.2 if rank == 1 else 0.0)
            yield {}

    batches = [TimedBatches(slow())]
    for _ in range(3):
        next(batches[0])
    waits[rank] = slowest_wait(batches, torch.device("cpu"))
    waits[rank + 2] = slowest_wait(batches, torch.device("cpu"))
    torch.distributed.destroy_process_group()


def test_every_rank_reports_the_slowest_ranks_data_wait_and_the_count_restarts(tmp_path):
    waits = torch.multiprocessing.get_context("spawn").Manager().list([0.0] * 4)
    torch.multiprocessing.spawn(_wait_on_rank, args=(str(tmp_path / "store"), waits), nprocs=2)
    assert 0.6 <= waits[0] == waits[1] < 1.5, list(waits)
    assert waits[2] == waits[3] == 0.0


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
     ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA B300", None)],
)  # fmt: skip
def test_mfu_peak_is_the_card_s_own_dense_bf16_rate(monkeypatch, name, peak):
    """The PCIe and NVL cards run slower than the SXM ones whose names theirs contain."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    assert peak_tflops() == peak
