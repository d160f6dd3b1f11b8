"""megatron_train.torchrun's exit code from torchrun's record of the failed ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_train.torchrun import exit_code, failure_line, main, parse_args
from tests.conftest import ROOT


def _failed(*codes: int) -> ChildFailedError:
    """Ranks 0, 1, ... failed in this order with these exit codes."""
    failures = {}
    for rank, code in enumerate(codes):
        failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")
        failure.timestamp = rank
        failures[rank] = failure
    return ChildFailedError("megatron_train.train", failures)


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ((2, 2), 2),  # every rank refused the config
        ((2, -15), 2),  # the first refused it; the agent ended the other with SIGTERM
        ((3, 3, -15), 3),  # stopped after the save
        ((2, 3), 1),  # ranks disagree
        ((-9, 2), 1),  # the first was killed (e.g. out of memory)
        ((1, -15), 1),  # training failed
    ],
)
def test_the_first_ranks_reported_code_is_the_launchers(codes, expected):
    assert exit_code(_failed(*codes)) == expected


@pytest.mark.parametrize(
    ("codes", "says"),
    [
        ((1, -15), "rank 0 failed first, with exit code 1; its output is above"),
        ((-9, -15), "rank 0 was killed by SIGKILL (the out-of-memory killer sends it: see dmesg)"),
        ((-11, 1), "rank 0 was killed by SIGSEGV before any other rank failed"),
        ((-7, -15), "rank 0 was killed by SIGBUS (a file it had mapped shrank: a dataset rewritten or cut"),
    ],
)
def test_the_launcher_names_the_first_failed_rank_and_how_it_ended(codes, says):
    assert failure_line(_failed(*codes)).startswith(says)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["0", "--config", "configs/demo.yaml"], "NPROC is 0"),
        (["000", "--config", "configs/demo.yaml"], "NPROC is 0"),
        (["eight", "--config", "configs/demo.yaml"], "'eight' is not a rank count"),
        (["-1", "--config", "configs/demo.yaml"], "'-1' is not a rank count"),
        pytest.param(
            [], "no GPU found", marks=pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="a GPU")
        ),
    ],
)
def test_the_local_launcher_refuses_a_rank_count_it_cannot_start(args, says):
    """Checked before torchrun starts: its own answer to 0 ranks is a bare AssertionError."""
    result = subprocess.run(["bash", "launch/local.sh", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: launch/local.sh: ") and says in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_the_local_launcher_passes_a_count_past_64_bits_on_as_written():
    """bash's arithmetic would wrap it into another number, which the refusal would then name."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = ["bash", "launch/local.sh", "0099999999999999999999", "--config", "configs/demo.yaml"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    count = "99999999999999999999"
    assert result.stderr.startswith(f"error: --nproc-per-node {count}: {count} ranks take at least")
    assert len(result.stderr.splitlines()) == 1


def test_the_local_launcher_refuses_a_python_without_the_project(tmp_path):
    """A shell whose ``python`` lacks torch (the environment not activated) is one line, not each
    rank's import traceback."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    env = {**os.environ, "PATH": f"{tmp_path / 'bare' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    command = ["bash", "launch/local.sh", "2", "--config", "configs/demo.yaml"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: launch/local.sh: '{tmp_path}/bare/bin/python' cannot import torch and megatron_train. Fix: "
        "activate the environment megatron-train is installed in (make install; source .venv/bin/activate)"
    ]


def test_every_command_refuses_a_python_without_the_project(tmp_path):
    """Each tool, the Slurm submitter and the trainer, started by a Python that lacks torch (the
    environment not activated), is one line and exit code 2 before anything runs, not the trace
    of an import that fails; the tools find this checkout's package without an install."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    tools = [tool for tool in sorted((ROOT / "tools").glob("*.py")) if tool.name != "use_checkout.py"]
    commands = [[str(tool), "--help"] for tool in tools]
    commands += [["launch/submit.py", "--help"], ["-m", "megatron_train.train", "--help"]]
    for command in commands:
        result = subprocess.run(
            [str(tmp_path / "bare" / "bin" / "python"), *command], cwd=ROOT, capture_output=True, text=True
        )
        assert (result.returncode, result.stdout) == (2, ""), (command, result.stderr)
        assert result.stderr.splitlines() == [
            f"error: {tmp_path}/bare/bin/python cannot import torch, so it is not the Python megatron-train "
            "is installed for. Fix: activate that environment (make install; source .venv/bin/activate)"
        ], command


def test_every_command_refuses_a_working_directory_that_no_longer_exists(tmp_path):
    """A shell left in a folder that was removed (a clean build, a test's temporary folder): each
    command is one line and exit code 2, not the FileNotFoundError of torch's import, which reads
    the working directory."""
    commands = [[str(tool), "--help"] for tool in sorted((ROOT / "tools").glob("*.py"))]
    commands += [[str(ROOT / "launch" / "submit.py"), "--help"], ["-m", "megatron_train.train", "--help"]]
    commands += [["-m", "megatron_train.torchrun", "--standalone", *TRAIN]]
    gone = tmp_path / "gone"
    for command in commands:
        if command[0].endswith("use_checkout.py"):
            continue
        gone.mkdir()
        script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
        result = subprocess.run(
            ["bash", "-c", script, "bash", str(gone), sys.executable, *command],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert (result.returncode, result.stdout) == (2, ""), (command, result.stderr)
        assert result.stderr.splitlines() == [
            f"error: the current directory ({gone}) no longer exists: it was removed or replaced after the "
            'shell entered it. Fix: cd to an existing directory (cd "$PWD" if it was made again) and run it '
            "again"
        ], command


TRAIN = ["-m", "megatron_train.train", "--config", "configs/demo.yaml"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nproc-per-node", "0", *TRAIN], "--nproc-per-node 0: 0 ranks per node"),
        (["--nproc-per-node", "two", *TRAIN], "--nproc-per-node two: Unsupported nproc_per_node"),
        # torchrun's own answers: an AssertionError, a ValueError deep in its rendezvous or agent, a
        # static rendezvous waiting forever, minutes of retries for an unknown address, its usage
        (["--nnodes", "0", *TRAIN], "--nnodes 0: not a node count"),
        (["--nnodes", "2:1", *TRAIN], "--nnodes 2:1: not a node count"),
        (["--standalone", "--nnodes", "2", *TRAIN], "--nnodes 2: --standalone keeps the rendezvous"),
        (["--nnodes", "99999999999", *TRAIN], "--nnodes 99999999999: 99,999,999,999 ranks in all"),
        (["--max-restarts", "-1", *TRAIN], "--max-restarts -1: below 0"),
        (["--master-port", "99999", *TRAIN], "--master-port 99999: not a port"),
        (["--nnodes", "2", "--rdzv-endpoint", "host:port", *TRAIN], "--rdzv-endpoint host:port"),
        (["--rdzv-endpoint", "node1", *TRAIN], "--rdzv-endpoint node1: the static rendezvous"),
        (["--nnodes", "2", "--rdzv-backend", "static", "--node-rank", "2", *TRAIN], "--node-rank 2: outside"),
        (["--rdzv-backend", "etcd3", *TRAIN], "--rdzv-backend etcd3: not a rendezvous backend"),
        (["--rdzv-backend", "etcd", *TRAIN], "--rdzv-backend etcd: needs the python-etcd package"),
        (
            ["--rdzv-conf", "join_timeout", *TRAIN],
            "--rdzv-conf join_timeout: 'join_timeout' is not key=value",
        ),
        (["--rdzv-conf", "join_timeout=-5", *TRAIN], "--rdzv-conf join_timeout=-5: join_timeout=-5 is not a"),
        (
            ["--local-addr", "no-such-host.invalid", *TRAIN],
            "--local-addr no-such-host.invalid: this node knows",
        ),
        (["--monitor-interval", "0", *TRAIN], "--monitor-interval 0: not a time to wait"),
        (["--monitor-interval", "nan", *TRAIN], "--monitor-interval nan: not a time to wait"),
        (
            ["--monitor-interval", "500", *TRAIN],
            "--monitor-interval 500: seconds between the launcher's looks at its ranks; a run that ended "
            "would go unnoticed that long. Fix: give at most 60",
        ),
        (["--monitor-interval", "99999999999", *TRAIN], "--monitor-interval 1e+11: seconds between"),
        (["--event-log-handler", "file", *TRAIN], "--event-log-handler file: no such handler"),
        (["--logs-specs", "json", *TRAIN], "--logs-specs json: no such logs spec"),
        (["--tee", "4", *TRAIN], "--tee 4: not a choice of streams"),
        (["--redirects", "0:3,1:9", *TRAIN], "--redirects 0:3,1:9: not a choice of streams"),
        (["--local-ranks-filter", "first", *TRAIN], "--local-ranks-filter first: not a list of local ranks"),
        (
            ["--nproc-per-node", "2", "--local-ranks-filter", "2,3", *TRAIN],
            "--local-ranks-filter 2,3: names none",
        ),
        (["--log-dir", "configs/demo.yaml/logs", *TRAIN], "--log-dir configs/demo.yaml/logs: configs/demo"),
        (["--log-dir", "n" * 300, *TRAIN], "--log-dir: the path '"),
        (
            ["--signals-to-handle", "SIGTERM,SIGFOO", *TRAIN],
            "--signals-to-handle SIGTERM,SIGFOO: 'SIGFOO' is not",
        ),
        (
            ["--signals-to-handle", "SIGKILL", *TRAIN],
            "--signals-to-handle SIGKILL: 'SIGKILL' is not a signal",
        ),
        (["--shutdown-timeout", "-1", *TRAIN], "--shutdown-timeout -1: below 0"),
        (["--standalone", "--bogus", *TRAIN], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: training_script"),
    ],
)
def test_torchrun_refuses_its_own_bad_arguments_in_one_line_before_any_rank(args, says, capsys):
    try:
        code = main(args)
    except SystemExit as exit_:  # a usage mistake, reported by the argument parser
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}"), err
    assert len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the binding needs no GPU to be refused")
def test_torchrun_refuses_numa_binding_without_a_gpu(capsys):
    assert main(["--numa-binding", "node", *TRAIN]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --numa-binding node: binds each rank to the NUMA node of its GPU"), err
    assert len(err.splitlines()) == 1


def test_torchrun_refuses_more_ranks_than_the_gpus_it_sees(capsys, monkeypatch):
    """Two ranks on one GPU: NCCL's answer is a "Duplicate GPU detected" traceback from each rank.
    The node's GPUs are a count torch reports; here it reports one, as the lent H100 machine does."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # A script that does not exist: were the ranks started, they would fail at once with exit 1.
    assert main(["--standalone", "--nproc-per-node", "2", "-m", "megatron_train.no_such_module"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --nproc-per-node 2: 2 ranks for the 1 GPU(s) this node shows"), err
    assert len(err.splitlines()) == 1


def test_torchrun_refuses_more_ranks_than_the_machines_memory_holds(capsys):
    """100,000 CPU ranks (a count mistyped) started hundreds of processes, each taking the
    launcher's own 0.3 GiB of torch and megatron-core, until the launcher was killed: refused
    before any starts, naming how many would fit."""
    assert main(["--standalone", "--nproc-per-node", "100000", "-m", "megatron_train.no_such_module"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --nproc-per-node 100000: 100000 ranks take at least "), err
    assert "GiB this machine has free. Fix: start at most " in err
    assert len(err.splitlines()) == 1


def test_the_launcher_passes_sigusr1_on_to_the_ranks(monkeypatch):
    """SIGUSR1 stops our ranks after a save, as SIGTERM does; torchrun passed on only its own four
    signals and died of this one, leaving its ranks training. torchrun's variable still decides."""
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    handled = parse_args(["--standalone", "-m", "megatron_train.train"]).signals_to_handle.split(",")
    assert {"SIGUSR1", "SIGTERM", "SIGINT"} <= set(handled)
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM")
    assert parse_args(["--standalone", "-m", "megatron_train.train"]).signals_to_handle == "SIGTERM"


def test_the_launcher_leaves_no_empty_log_folders_behind_and_keeps_logs(tmp_path):
    """torchrun makes a log folder in the temporary directory at every launch: without
    --log-dir, the launcher removes it unless it holds a log."""
    script = tmp_path / "rank.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'])\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    command = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node", "2"]
    for redirect in ([], ["--redirects", "3"]):
        result = subprocess.run([*command, *redirect, str(script)], cwd=ROOT, env=env, capture_output=True,
                                text=True)  # fmt: skip
        assert result.returncode == 0, result.stderr
    logs = sorted(path.read_text() for path in temp.glob("torchelastic_*/*/attempt_0/*/stdout.log"))
    assert logs == ["rank 0\n", "rank 1\n"]
    assert len(list(temp.glob("torchelastic_*"))) == 1, "the launch without redirects left its folder"


def test_the_launcher_starts_without_importing_megatron_core():
    """The launcher's imports come before every rank's on each launch and relaunch: megatron-core
    and the training modules (2.5 s of each launch on a 2-core machine) are the ranks' to import."""
    probe = (
        "import sys, megatron_train.torchrun; "
        "print(sorted(m for m in sys.modules if m.startswith(('megatron.', 'megatron_train.train'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
