"""The Slurm launch path on a real two-node Slurm (slurm-wlm + munge on loopback).

The fixture installs slurm-wlm and munge when missing (apt, as root), starts munged, slurmctld
and two slurmd daemons (``-N n1`` / ``-N n2``) from a generated slurm.conf, and tears them down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, load_tool, records, write_config

# One test cluster at a time: every Slurm test runs on the same xdist worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

SLURM_CONF = """\
ClusterName=mtrain-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobRequeue=1
MinJobAge=3600
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=4 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=4 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _run(*cmd: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=check)


def _ensure_installed() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    assert os.geteuid() == 0, "installing slurm-wlm and munge needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    installed = _run("apt-get", "install", "-y", "-q", "slurm-wlm", "munge", env=env, check=False)
    if installed.returncode != 0:
        _run("apt-get", "update", "-q", env=env)
        _run("apt-get", "install", "-y", "-q", "slurm-wlm", "munge", env=env)


def _ensure_munged() -> None:
    if _run("pgrep", "-x", "munged", check=False).returncode == 0:
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        _run("mungekey", "--create")
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    _run("munged", "--force")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """Environment (SLURM_CONF) of a running two-node cluster."""
    _ensure_installed()
    _ensure_munged()
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=d, ctld_port=free_port(), n1_port=free_port(), n2_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    _run("slurmctld", "-c", "-f", str(conf), env=env)
    _run("slurmd", "-N", "n1", "-f", str(conf), env=env)
    _run("slurmd", "-N", "n2", "-f", str(conf), env=env)
    deadline = time.monotonic() + 60
    while "idle" not in _run("sinfo", "-h", "-o", "%T %D", env=env, check=False).stdout:
        assert time.monotonic() < deadline, (d / "slurmctld.log").read_text()[-2000:]
        time.sleep(1)
    yield env
    _run("scancel", "--user=root", env=env, check=False)
    for pid_file in d.glob("*.pid"):
        _run("kill", pid_file.read_text().strip(), check=False)


def submit(
    slurm: dict, config: Path, log_dir: Path, *overrides: str, extra: tuple = ()
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch/submit.py", "--config", str(config), "--cpu", "--nodes", "2",
           "--gpus-per-node", "2", "--time", "10", "--log-dir", str(log_dir), *extra,
           "parallel.tensor=2", "parallel.pipeline=2", *overrides]  # fmt: skip
    return subprocess.run(
        cmd, cwd=ROOT, env={**slurm, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
    )


def sbatch_rank_per_node(
    slurm: dict, config: Path, logs: Path, *options: str, nodes: int = 1, python: str = sys.executable
) -> str:
    """A job of the batch script, one rank on each of ``nodes`` nodes, submitted with sbatch itself
    with ``options``; its id."""
    logs.mkdir()
    env = {**slurm, "MT_CONFIG": str(config), "MT_LOG_DIR": str(logs), "MT_REPO": str(ROOT),
           "MT_PYTHON": python}  # fmt: skip
    return _run("sbatch", "--parsable", *options, f"--nodes={nodes}", "--ntasks-per-node=1",
                f"--output={logs}/%x-%j.out", str(ROOT / "launch" / "slurm" / "pretrain.sbatch"),
                f"parallel.tensor={nodes}", env=env).stdout.strip()  # fmt: skip


def wait_for_step(slurm: dict, job: str, rank0: Path, step: int) -> None:
    """Until rank 0's log shows ``step`` trained (the job still pending or running meanwhile)."""
    deadline = time.monotonic() + 300
    while not (rank0.exists() and f"step {step}/" in rank0.read_text()):
        assert time.monotonic() < deadline and job_field(slurm, job, "JobState") in ("PENDING", "RUNNING")
        time.sleep(0.5)


def job_field(slurm: dict, job: str, field: str) -> str:
    out = _run("scontrol", "show", "job", job, env=slurm).stdout
    return next(tok.split("=", 1)[1] for tok in out.split() if tok.startswith(field + "="))


def wait_for_job(slurm: dict, job: str, timeout: float = 400) -> str:
    deadline = time.monotonic() + timeout
    released = False
    while (state := job_field(slurm, job, "JobState")) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, f"job {job} still {state}"
        if state == "PENDING" and not released and job_field(slurm, job, "Reason") == "BeginTime":
            # slurmctld holds a requeued job for AuthInfo's cred_expire (120 s by default); the test
            # need not wait it out. Not at once: slurmd revokes the old run's credential with
            # one-second resolution, and a restart inside that second is killed as "Job credential
            # revoked". Once: each update sets the begin time anew, and updating it at every poll
            # (to a few seconds ahead) held the job back for as long as the polls went on.
            time.sleep(3)
            _run("scontrol", "update", f"JobId={job}", "StartTime=now", env=slurm, check=False)
            released = True
        time.sleep(2)
    return state


STEPS = 30


@pytest.fixture(scope="module")
def uninterrupted(slurm, corpus, tmp_path_factory) -> dict:
    """A 2-node TP2 x PP2 job (ranks 0-1 on n1, 2-3 on n2) run to completion."""
    d = tmp_path_factory.mktemp("slurm_a")
    config = write_config(d / "cfg.yaml", corpus, d / "run", train={"steps": STEPS, "eval_interval": 0},
                          checkpoint={"interval": 10})  # fmt: skip
    # sbatch reads % in --output as a pattern (the job's log went to a folder that did not exist,
    # and the job failed without a line); a space must survive the batch script's quoting.
    logs = d / "logs %j"
    result = submit(slurm, config, logs)
    assert result.returncode == 0, result.stderr
    job = result.stdout.split()[-1]
    assert wait_for_job(slurm, job) == "COMPLETED", (logs / f"megatron-train-{job}.out").read_text()
    return {"logs": logs, "job": job, "run": d / "run"}


def test_two_node_job_completes(slurm, uninterrupted):
    job = uninterrupted["job"]
    logs = uninterrupted["logs"] / f"megatron-train-{job}"
    assert sorted(p.name for p in logs.glob("rank-*.log")) == [f"rank-{i}.log" for i in range(4)]
    assert "done. run directory" in (logs / "rank-0.log").read_text()
    assert "layout TP=2 PP=2 VPP=1 DP=1 on 4 cpu ranks" in (logs / "rank-0.log").read_text()
    assert job_field(slurm, job, "NodeList") == "n[1-2]"
    assert [r["step"] for r in records(uninterrupted["run"])] == list(range(1, STEPS + 1))


def test_pre_timeout_signal_saves_requeues_and_resumes_to_the_same_loss(
    slurm, corpus, uninterrupted, tmp_path
):
    train = {"steps": STEPS, "eval_interval": 0}
    checkpoint = {"interval": 10}
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train=train, checkpoint=checkpoint)
    result = submit(slurm, config, tmp_path / "logs")
    assert result.returncode == 0, result.stderr
    job = result.stdout.split()[-1]
    rank0 = tmp_path / "logs" / f"megatron-train-{job}" / "rank-0.log"
    wait_for_step(slurm, job, rank0, 4)
    # What Slurm's --signal=USR1@<seconds> does before the time limit: SIGUSR1 to every task.
    _run("scancel", "--signal=USR1", job, env=slurm)
    assert wait_for_job(slurm, job) == "COMPLETED"
    batch_log = (tmp_path / "logs" / f"megatron-train-{job}.out").read_text()
    assert "requeueing to resume" in batch_log and job_field(slurm, job, "Restarts") == "1"
    text = rank0.read_text()
    assert "on signal SIGUSR1" in text and "resumed from" in text and "done. run directory" in text
    losses = [r["loss"] for r in records(tmp_path / "run")]
    expected = [r["loss"] for r in records(uninterrupted["run"])]
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, STEPS + 1))
    assert losses == expected, "the requeued job must end exactly where the uninterrupted one did"


@pytest.mark.parametrize("n2_misses_it", [False, True], ids=["both-nodes", "one-node"])
def test_a_pre_timeout_signal_while_the_ranks_start_is_one_line_and_no_requeue(
    slurm, corpus, tmp_path, n2_misses_it
):
    """Slurm's SIGUSR1 before the ranks catch it (a --time shorter than start-up plus
    --signal-seconds): they die of it in their imports, and the job failed with exit code 138 and
    no word of why. Now the batch log says so in one line, the job is not requeued (its next start
    would be signalled as early) and nothing of a run was made. When only one node's ranks die of
    it, srun terminates the others and reports 143 (seen under load in CI); one-node makes that
    order certain: n2's ranks start with SIGUSR1 ignored, as if it reached them out of order."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    extra = ()
    if n2_misses_it:
        python = tmp_path / "python"
        python.write_text(
            f'#!/bin/bash\n[[ $SLURMD_NODENAME == n2 ]] && trap "" USR1\nexec {sys.executable} "$@"\n'
        )
        python.chmod(0o755)
        extra = ("--python", str(python))
    result = submit(slurm, config, tmp_path / "logs", extra=extra)
    assert result.returncode == 0, result.stderr
    job = result.stdout.split()[-1]
    ranks = tmp_path / "logs" / f"megatron-train-{job}"
    deadline = time.monotonic() + 120
    # slurmstepd opens each rank's log before it starts the rank, whose imports take seconds.
    while len(list(ranks.glob("rank-*.log"))) < 4:
        assert time.monotonic() < deadline and job_field(slurm, job, "JobState") in ("PENDING", "RUNNING")
        time.sleep(0.1)
    _run("scancel", "--signal=USR1", job, env=slurm)
    assert wait_for_job(slurm, job) == "FAILED"
    batch_log = (tmp_path / "logs" / f"megatron-train-{job}.out").read_text()
    assert f"job {job}: SIGUSR1 (the pre-timeout signal) ended the ranks while they were" in batch_log
    assert "failed with exit code" not in batch_log
    if n2_misses_it:
        assert "n1: tasks 0-1: User defined signal 1" in batch_log
        assert "n2: tasks 2-3: User defined signal 1" not in batch_log
    assert job_field(slurm, job, "Restarts") == "0"
    assert not (tmp_path / "run").exists()


def test_submit_refuses_a_bad_config_without_queueing(slurm, corpus, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    result = submit(slurm, config, tmp_path / "logs", "model.num_attention_heads=3")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "model.num_attention_heads" in result.stderr and "Nothing was submitted" in result.stderr
    assert _run("squeue", "-h", "-n", "megatron-train", "-t", "PD,R", env=slurm).stdout.strip() == ""


@pytest.mark.parametrize("nodes", [1, 2], ids=["every-node", "one-node-of-two"])
def test_a_node_that_cannot_start_its_ranks_fails_the_job_at_once(slurm, corpus, tmp_path, nodes):
    """A node that cannot open its rank's log (here a folder in its place; a log dir outside the
    shared file system in life): srun exited 0 when no rank started, so the job read as COMPLETED
    without a step trained, and where only one node's ranks failed to start, the others waited
    in the rendezvous for the collective timeout (10 minutes) before the job failed."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    logs = tmp_path / "logs"
    job = sbatch_rank_per_node(slurm, config, logs, "--hold", nodes=nodes)
    (logs / f"megatron-train-{job}" / f"rank-{nodes - 1}.log").mkdir(parents=True)
    _run("scontrol", "release", job, env=slurm)
    assert wait_for_job(slurm, job, timeout=120) == "FAILED"
    assert job_field(slurm, job, "ExitCode") == "2:0"
    batch_log = (logs / f"megatron-train-{job}.out").read_text()
    assert f"error: job {job} cannot start its ranks on nodes n{nodes}: rank {nodes - 1} on node n{nodes}" \
        " cannot write its log" in batch_log  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_node_whose_python_lacks_the_project_fails_the_job_at_once(slurm, corpus, tmp_path):
    """A node-local environment that lacks torch (here n2's python runs without site-packages):
    its rank died in an import traceback, and the job failed naming only the exit code."""
    python = tmp_path / "python"
    n2_without_site = f'[[ $SLURMD_NODENAME == n2 ]] && exec {sys.executable} -S "$@"'
    python.write_text(f'#!/bin/bash\n{n2_without_site}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    logs = tmp_path / "logs"
    job = sbatch_rank_per_node(slurm, config, logs, nodes=2, python=str(python))
    assert wait_for_job(slurm, job, timeout=120) == "FAILED"
    batch_log = (logs / f"megatron-train-{job}.out").read_text()
    assert f"error: job {job} cannot start its ranks on nodes n2: rank 1 on node n2 cannot import torch" \
        f" and megatron_train with {python} (MT_PYTHON)" in batch_log  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_stop_save_that_cannot_be_requeued_fails_the_job_with_a_line(slurm, corpus, tmp_path):
    """A job Slurm will not requeue (``--no-requeue`` here; a site's policy in life) read as
    COMPLETED after its pre-timeout save, as if the run had finished."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 1000, "eval_interval": 0}
    )
    logs = tmp_path / "logs"
    job = sbatch_rank_per_node(slurm, config, logs, "--no-requeue")
    wait_for_step(slurm, job, logs / f"megatron-train-{job}" / "rank-0.log", 2)
    _run("scancel", "--signal=USR1", job, env=slurm)
    assert wait_for_job(slurm, job) == "FAILED"
    assert job_field(slurm, job, "ExitCode") == "3:0" and job_field(slurm, job, "Restarts") == "0"
    batch_log = (logs / f"megatron-train-{job}.out").read_text()
    assert "could not be requeued (scontrol's line above says why): submit it again to resume" in batch_log


def test_a_dataset_cut_while_the_job_reads_it_fails_the_job_with_a_line(slurm, corpus, tmp_path):
    """The rank dies of SIGBUS without a word of its own; the job said only its exit code."""
    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus["prefix"].with_suffix(suffix), data / f"d{suffix}")
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 1000, "eval_interval": 0},
        data={"blend": [str(data / "d")]},
    )  # fmt: skip
    logs = tmp_path / "logs"
    job = sbatch_rank_per_node(slurm, config, logs, "--no-requeue")
    wait_for_step(slurm, job, logs / f"megatron-train-{job}" / "rank-0.log", 1)
    os.truncate(data / "d.bin", 4096)
    assert wait_for_job(slurm, job) == "FAILED"
    batch_log = (logs / f"megatron-train-{job}.out").read_text()
    assert f"job {job} failed: a rank was killed by SIGBUS (srun's line above): a file it had mapped" \
        " shrank" in batch_log  # fmt: skip
    assert "failed with exit code" not in batch_log


@pytest.mark.parametrize("count", ["twenty", "-1", "9223372036854775808"])
def test_the_batch_script_refuses_a_requeue_count_it_cannot_compare_before_anything(tmp_path, count):
    """Read at the first stop, hours in: bash took a word for 0 requeues and wrapped a count past
    63 bits, and the job ended as "already requeued twenty times"."""
    env = {
        **os.environ,
        "MT_CONFIG": "cfg.yaml",
        "MT_MAX_REQUEUES": count,
        "MT_LOG_DIR": str(tmp_path / "logs"),
    }
    result = _run("bash", str(ROOT / "launch" / "slurm" / "pretrain.sbatch"), env=env, check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: MT_MAX_REQUEUES='{count}' is not a count of requeues. Fix: export a whole number such as "
        "20 (launch/submit.py --max-requeues sets it)"
    ]
    assert not (tmp_path / "logs").exists()


def test_sbatch_script_is_valid_bash():
    assert _run("bash", "-n", str(ROOT / "launch" / "slurm" / "pretrain.sbatch")).returncode == 0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60", 3600), ("30:00", 1800), ("5:30", 330), ("24:00:00", 86400), ("2-12", 216000),
     ("1-02:03", 93780), ("2-00:00:05", 172805), ("0", None), ("UNLIMITED", None)],
)  # fmt: skip
def test_slurm_times_are_read_as_sbatch_reads_them(text, seconds):
    """sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; 0 is no limit."""
    assert load_tool("launch/submit.py").slurm_seconds(text) == seconds


@pytest.mark.parametrize(
    ("python", "image", "job_python"),
    [("venv/bin/python", None, "HERE/venv/bin/python"), ("python3", None, "python3"),
     ("venv/bin/python", "x.sqsh", "venv/bin/python"), (None, "x.sqsh", "python")],
)  # fmt: skip
def test_the_ranks_python_is_the_one_named_from_where_the_job_starts(python, image, job_python, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    """The job starts in the repo: a relative path is made absolute, outside a container (in one,
    it names a file of the image's)."""
    submit = load_tool("launch/submit.py")
    monkeypatch.chdir(tmp_path)
    argv = ["--config", "c.yaml", *(["--python", python] if python else []),
            *(["--container-image", image] if image else [])]  # fmt: skip
    variables = submit.job_variables(submit.parse_args(argv))
    assert variables["MT_PYTHON"] == job_python.replace("HERE", str(tmp_path))


def test_a_request_sbatch_refuses_is_one_line_and_leaves_no_log_dir(slurm, corpus, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    logs = tmp_path / "logs" / "new"
    result = submit(slurm, config, logs, extra=("--partition", "nonexistent"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: sbatch refused the job: "), result.stderr
    assert "partition" in result.stderr and "Nothing was submitted" in result.stderr
    assert not logs.exists()


@pytest.mark.parametrize(
    ("extra", "python"),
    [((), sys.executable), (("--container-image", "/shared/mt.sqsh"), "python"),
     (("--container-image", "/shared/mt.sqsh", "--python", "/opt/venv/bin/python"), "/opt/venv/bin/python")],
)  # fmt: skip
def test_dry_run_prints_the_job_s_variables_and_a_container_runs_its_own_python(
    tmp_path, capsys, extra, python
):
    """A login node's interpreter does not exist in a container image (or runs the host's packages)."""
    config = tmp_path / "cfg.yaml"
    config.write_text("{}\n")
    submit_main = load_tool("launch/submit.py").main
    logs = tmp_path / "logs"
    argv = ["--config", str(config), "--skip-preflight", "--dry-run", "--log-dir", str(logs), *extra]
    assert submit_main(argv) == 0
    mkdir, _, words = capsys.readouterr().out.partition(" && ")
    assert mkdir == f"mkdir -p {logs}"
    words = words.split()
    assert words[0] == "env" and f"MT_PYTHON={python}" in words and f"MT_CONFIG={config}" in words
    assert words[words.index("sbatch") - 1].startswith("MT_")
    assert not logs.exists()
