"""Submit a pretraining job to Slurm: preflight first, then sbatch launch/slurm/pretrain.sbatch.

    python launch/submit.py --config configs/llama3_8b.yaml --nodes 4 --time 24:00:00 \\
        --partition gpu --account myproj [--container-image nvcr.io#...] [key=value ...]

Nothing is submitted when the preflight finds a problem (exit 2). --dry-run prints the sbatch
command, with the variables pretrain.sbatch reads, instead of running it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's package, installed or not: its import names a Python without the project's
# environment in one line (megatron_train/__init__.py), where an import would fail with a traceback.
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402
from megatron_train.config_loading import override_for_option  # noqa: E402
from megatron_train.errors import NAME_MAX, ConfigError  # noqa: E402
from megatron_train.outputs import check_output_dir  # noqa: E402

SBATCH_SCRIPT = ROOT / "launch" / "slurm" / "pretrain.sbatch"


# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_SLURM_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|infinite)")


def slurm_time(text: str) -> str:
    if not _SLURM_TIME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Slurm time such as 24:00:00 or 2-00:00:00")
    return text


# The job's log file is NAME-JOBID.out, a name of at most 255 bytes; a job ID has up to 10 digits.
JOB_NAME_MAX = NAME_MAX - len("-4294967295.out")


def slurm_name(text: str) -> str:
    """A name sbatch passes on as it is: no Slurm name holds a control character, yet a cluster
    that enforces no accounts queued ``--account $'a\\nb'`` (Slurm 22.05)."""
    text = cli.non_empty(text)
    if not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r} holds a control character (a newline or tab)")
    return text


def job_name(text: str) -> str:
    """A job name: it names the job's log file and folder, so it holds no ``/`` (Slurm does not
    make the folder that would ask for, and a job whose output file cannot open fails with no log:
    JobLaunchFailure on Slurm 22.05)."""
    text = slurm_name(text)
    if "/" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a '/', but it names the job's log file")
    if len(text.encode()) > JOB_NAME_MAX:
        raise argparse.ArgumentTypeError(
            f"a name of {len(text.encode())} bytes, but it names the job's log file NAME-JOBID.out, "
            f"so it may have at most {JOB_NAME_MAX} bytes"
        )
    return text


def container_mounts(text: str) -> str:
    """pyxis's mount list: comma-separated ``SRC[:DST[:FLAGS]]``, none of the parts empty."""
    for mount in text.split(","):
        parts = mount.split(":")
        if len(parts) > 3 or not all(part.strip() for part in parts):
            raise argparse.ArgumentTypeError(
                f"{mount!r} in {text!r} is not a pyxis mount such as /data:/data or /data:/data:ro"
            )
    return text


def slurm_seconds(text: str) -> int | None:
    """The seconds a Slurm time names; None for no limit (0, UNLIMITED, infinite)."""
    if text in ("UNLIMITED", "infinite"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    else:  # MM, MM:SS
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return total or None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(override_for=override_for_option, description=__doc__)
    parser.add_argument("--config", type=cli.non_empty, required=True, help="experiment YAML")
    parser.add_argument("--nodes", type=cli.positive_int, default=1)
    parser.add_argument(
        "--gpus-per-node", type=cli.positive_int, default=8, help="ranks per node (one per GPU)"
    )
    parser.add_argument("--cpu", action="store_true", help="CPU-only nodes: no --gpus-per-node request")
    parser.add_argument("--time", type=slurm_time, default="24:00:00", help="time limit (sbatch --time)")
    parser.add_argument("--partition", type=slurm_name)
    parser.add_argument("--account", type=slurm_name)
    parser.add_argument("--job-name", type=job_name, default="megatron-train")
    parser.add_argument("--signal-seconds", type=cli.signal_seconds, default=300,
                        help="send SIGUSR1 this long before the time limit (save, then requeue)")  # fmt: skip
    parser.add_argument("--max-requeues", type=cli.shell_count, default=20)
    parser.add_argument(
        "--container-image", type=cli.non_empty, help="pyxis/enroot image (e.g. a .sqsh from enroot import)"
    )
    parser.add_argument(
        "--container-mounts", type=container_mounts, help="extra pyxis mounts, src:dst[,src:dst]"
    )
    parser.add_argument(
        "--log-dir", type=cli.non_empty, default="logs", help="per-job directory with per-rank logs goes here"
    )
    parser.add_argument(
        "--python",
        type=cli.non_empty,
        help="interpreter on the compute nodes (default: this one; in a container, the image's python)",
    )
    parser.add_argument("--skip-preflight", action="store_true")
    parser.add_argument(
        "--gpu-memory-gib",
        type=cli.positive_float,
        default=80.0,
        help="preflight refuses layouts estimated above this",
    )
    parser.add_argument("--allow-over-memory", action="store_true", help="submit above --gpu-memory-gib")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch command, do not submit")
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return parser.parse_intermixed_args(argv)


def sbatch_command(args: argparse.Namespace) -> list[str]:
    """The sbatch command line for these arguments."""
    # sbatch reads % in --output as the start of a pattern (%j: the job id): %% is a plain one.
    log_dir = str(Path(args.log_dir).resolve()).replace("%", "%%")
    cmd = ["sbatch", "--parsable", f"--job-name={args.job_name}", f"--nodes={args.nodes}",
           f"--ntasks-per-node={args.gpus_per_node}", f"--time={args.time}",
           f"--signal=USR1@{args.signal_seconds}", f"--output={log_dir}/%x-%j.out"]  # fmt: skip
    if not args.cpu:
        cmd.append(f"--gpus-per-node={args.gpus_per_node}")
    if args.partition:
        cmd.append(f"--partition={args.partition}")
    if args.account:
        cmd.append(f"--account={args.account}")
    return [*cmd, str(SBATCH_SCRIPT), *args.overrides]


def job_variables(args: argparse.Namespace) -> dict[str, str]:
    """What pretrain.sbatch reads, on top of the submitting environment that sbatch exports."""
    # Inside a container this interpreter's path (a venv on the login node) would run the host's
    # packages, or nothing; the image's own python has the stack the image was built with.
    python = args.python or ("python" if args.container_image else sys.executable)
    if not args.container_image and os.sep in python:
        # The job starts in MT_REPO, not here. No symlinks resolved: a venv's python is one.
        python = os.path.abspath(python)
    env = {
        "MT_CONFIG": str(Path(args.config).resolve()),
        "MT_PYTHON": python,
        "MT_MAX_REQUEUES": str(args.max_requeues),
        "MT_LOG_DIR": str(Path(args.log_dir).resolve()),
        "MT_REPO": str(ROOT),
    }
    if args.container_image:
        env["MT_CONTAINER_IMAGE"] = args.container_image
    if args.container_mounts:
        env["MT_CONTAINER_MOUNTS"] = args.container_mounts
    return env


def check_args(args: argparse.Namespace) -> None:
    """What sbatch would take but the job could not use."""
    limit = slurm_seconds(args.time)
    if limit is not None and args.signal_seconds >= limit:
        raise ConfigError(
            "--signal-seconds",
            f"{args.signal_seconds} s is not shorter than --time {args.time} ({limit} s): the job would "
            "be told to save and requeue as it starts",
            "give a longer --time or fewer --signal-seconds",
        )
    check_output_dir("--log-dir", Path(args.log_dir))
    if "\\" in str(Path(args.log_dir).resolve()):
        raise ConfigError(
            "--log-dir",
            f"{args.log_dir!r} holds a backslash, which makes sbatch read the job's log name %x-%j.out "
            "as it stands: every job would write the same file",
            "name a folder without a backslash",
        )
    if args.container_mounts and not args.container_image:
        raise ConfigError(
            "--container-mounts",
            "mounts into a container, but no --container-image is given",
            "add --container-image, or drop --container-mounts",
        )
    if args.python and not args.container_image:
        check_python(args.python)


# The compute nodes start every rank with this interpreter; without a container they share the
# login node's file systems, so an interpreter that cannot start training here would fail there
# too, after the job waited in the queue.
_TRAINING_IMPORTS = "import torch, megatron.core, megatron_train.train"


def check_python(python: str) -> None:
    """That ``python`` exists here and imports what training needs."""
    found = shutil.which(python)
    if found is None:
        raise ConfigError(
            "--python",
            f"{python!r} is not an executable file on this node",
            "give the interpreter that has megatron-train's dependencies (e.g. the venv's bin/python), "
            "or leave --python out to use this one",
        )
    try:
        result = subprocess.run(
            [found, "-c", _TRAINING_IMPORTS],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(
            "--python", f"{python!r} could not be run: {err}", "give a Python interpreter"
        ) from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit code {result.returncode}"
        raise ConfigError(
            "--python",
            f"{python!r} cannot import what training needs ({why})",
            "give the interpreter of the environment megatron-train is installed in, or leave --python out "
            "to use this one",
        )


# sbatch's own words for a cluster it could not reach or that cannot take jobs now; any other
# refusal is of the request (a partition, account, QOS or resource it does not know).
_UNREACHABLE = ("unable to contact", "timed out", "connection", "zero bytes", "authentication",
                "standby", "temporarily unable", "munge", "configuration file")  # fmt: skip


def sbatch_refusal(stderr: str) -> tuple[str, int]:
    """The one-line reason of a failed sbatch, and the exit code it maps to: 2 for a request the
    cluster refused (the user fixes an option), 1 for a cluster that could not be reached."""
    lines = [re.sub(r"^(sbatch: )?(error|fatal): ", "", line.strip()) for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    reason = "; ".join(dict.fromkeys(lines)) or "no reason given"
    unreachable = any(word in reason.lower() for word in _UNREACHABLE)
    return reason, cli.EXIT_FAILED if unreachable else cli.EXIT_BAD_INPUT


def preflight(args: argparse.Namespace) -> subprocess.CompletedProcess:
    """The preflight of this job's config and layout, its report (or error) on stderr."""
    cmd = [sys.executable, "-m", "megatron_train.preflight", "--config", args.config,
           "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node),
           "--gpu-memory-gib", str(args.gpu_memory_gib)]  # fmt: skip
    if args.allow_over_memory:
        cmd.append("--allow-over-memory")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*cmd, *args.overrides], env=env, stderr=subprocess.PIPE, text=True)


def sbatch(args: argparse.Namespace, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` (sbatch) with the job's environment; the log folder it needs exists only when
    a job was queued."""
    log_dir = Path(args.log_dir)
    created = [p for p in (log_dir, *log_dir.parents) if not p.exists()]
    log_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(cmd, env={**os.environ, **job_variables(args)}, capture_output=True, text=True)
    if result.returncode != 0:
        for folder in created:
            folder.rmdir()
    return result


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except ConfigError as err:
        cli.report(f"{err}. Nothing was submitted.")
        return cli.EXIT_BAD_INPUT
    if not args.dry_run and shutil.which("sbatch") is None:
        cli.report(
            "sbatch is not on PATH: this machine cannot submit Slurm jobs. Fix: run submit.py on the "
            "cluster's login node, or add --dry-run to print the command. Nothing was submitted."
        )
        return cli.EXIT_BAD_INPUT
    report = ""
    if not args.skip_preflight:
        checked = preflight(args)
        if checked.returncode != 0:
            errors = [line for line in checked.stderr.splitlines() if line.startswith("error: ")]
            why = (
                errors[-1].removeprefix("error: ")
                if errors
                else checked.stderr.strip() or "the preflight failed"
            )
            cli.report(f"{why.rstrip('.')}. Nothing was submitted.")
            return cli.EXIT_BAD_INPUT
        report = checked.stderr
    cmd = sbatch_command(args)
    if args.dry_run:
        sys.stderr.write(report)
        # As pasted into a shell: sbatch does not make the folder its --output names.
        assignments = [f"{name}={value}" for name, value in job_variables(args).items()]
        mkdir = shlex.join(["mkdir", "-p", str(Path(args.log_dir).resolve())])
        print(f"{mkdir} && {shlex.join(['env', *assignments, *cmd])}")
        return 0
    result = sbatch(args, cmd)
    if result.returncode != 0:
        reason, code = sbatch_refusal(result.stderr)
        fix = (
            "try again once the cluster answers"
            if code == cli.EXIT_FAILED
            else "correct the option it names (--partition, --account, --nodes, --gpus-per-node, --time)"
        )
        cli.report(f"sbatch refused the job: {reason}. Fix: {fix}. Nothing was submitted.")
        return code
    # The preflight's report only for a job that was queued: a refusal stays one line.
    sys.stderr.write(report)
    job_id = result.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; logs: {Path(args.log_dir).resolve()}/{args.job_name}-{job_id}.out "
          f"and {Path(args.log_dir).resolve()}/{args.job_name}-{job_id}/rank-*.log")  # fmt: skip
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
