"""What the three adapter demos share: the kill-and-resume story around their training process.

Each demo (``lightning_train.py``, ``accelerate_train.py``, ``hf_trainer_train.py``) is one script that is both the
story (:func:`kill_and_resume`, run with no arguments) and one machine's training process (run by the story with
``--child``, the options :func:`child_options` parses). The story:

1. machine 1 trains with an empty ``local_dir``, synced to a remote, and is SIGKILLed (:func:`preempt`) mid-run;
2. machine 2 starts with another empty ``local_dir`` and resumes from the remote alone, and finishes;
3. an uninterrupted reference run without checkpoints: the resumed weights must be bit-identical (:func:`finish`
   prints the fingerprint each process ends with).

The remote is a local moto S3 server when ``moto`` is installed (``make demo``), else a ``file://`` directory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def remote_storage(out: Path, run: str):
    """A moto S3 server with a bucket when moto is installed, else a file:// directory."""
    try:
        import moto  # noqa: F401
        import s3fs
    except ImportError:
        yield (out / "remote" / run).as_uri(), None
        return
    from tests.support.moto_server import CREDENTIALS, moto_server

    os.environ.update(CREDENTIALS)
    with moto_server() as endpoint:
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).mkdir("demo")
        yield f"s3://demo/{run}", endpoint


def listing(local_dir: Path) -> str:
    return ", ".join(f"{p.name} -> {os.readlink(p)}" if p.is_symlink() else p.name for p in sorted(local_dir.iterdir()))


def run_machine(cmd: list[str], run_id: str | None = None) -> dict | None:
    """Run one machine's training process: its last JSON line, or ``None`` when it was SIGKILLed.

    ``run_id``: the job's id, as a scheduler gives each restart of one job (``SLURM_JOB_ID``,
    ``TORCHELASTIC_RUN_ID``; here ``PERSIST_RUN_ID``): the machine that takes over continues that run's
    lease on the remote even when the first was killed before any upload committed.
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"PERSIST_RUN_ID": run_id} if run_id else {})}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode == -signal.SIGKILL:
        return None
    if run.returncode != 0:
        sys.exit(f"training failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def remote_steps(scratch: Path, remote: str, endpoint: str | None) -> list[int]:
    """The committed steps on the remote."""
    from persist_core import CheckpointReader

    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
    with CheckpointReader(scratch, remote_url=remote, storage_options=options) as reader:
        return [c.step for c in reader.list("remote")]


def child_options() -> argparse.Namespace:
    """The options a demo script takes; ``child`` is set when it runs as one machine's training process."""
    parser = argparse.ArgumentParser(description="one machine of the demo (the story itself: no arguments)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local-dir", help=argparse.SUPPRESS)  # none: the reference run, no checkpoints
    parser.add_argument("--remote", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the machine's own scratch directory
    parser.add_argument("--kill-at", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def storage_options(endpoint: str | None) -> dict[str, Any] | None:
    """The remote's fsspec options: the moto server's endpoint, or none for a ``file://`` remote."""
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None


def preempt() -> None:
    """SIGKILL this process: no warning, no handler, no cleanup (a preempted machine)."""
    os.kill(os.getpid(), signal.SIGKILL)


def finish(model: Any, **report: Any) -> None:
    """The process's last line: ``report`` and a fingerprint of the exact bytes of the model's parameters."""
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(json.dumps({**report, "digest": digest}), flush=True)


def kill_and_resume(script: str, name: str, run: str, *, kill_at: int, intro: str, machine_2: str,
                    resumed: Callable[[dict], str], after_kill: Callable[[Path], str] = lambda out: "",
                    show_machine_2: bool = True) -> int:
    """The story, under ``demo-out/<name>``, the remote's run named ``run``; 0 when the resumed weights are
    bit-identical to the reference's.

    Args:
        script: the demo's own file (its ``--child`` runs a machine).
        kill_at: passed to machine 1 as ``--kill-at`` (the script says what it means: a step, a save).
        intro: the first line, ``{remote}`` filled in.
        machine_2: the line before machine 2 starts.
        resumed: what to say of machine 2's last line.
        after_kill: more to say after machine 1's ``local_dir`` (from ``demo-out/<name>``).
        show_machine_2: list machine 2's ``local_dir`` after it finished.
    """
    out = ROOT / "demo-out" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with remote_storage(out, run) as (remote, endpoint):

        def machine(label: str, local: bool = True, **flags: Any) -> dict | None:
            cmd = [sys.executable, script, "--child", "--remote", remote, "--out", str(out / f"{label}-out")]
            cmd += (["--local-dir", str(out / label)] if local else []) + (["--endpoint", endpoint] if endpoint else [])
            cmd += [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]
            return run_machine(cmd, run_id=f"demo-{run}" if local else None)

        print(intro.format(remote=remote))
        assert machine("machine-1", kill_at=kill_at) is None, "machine 1 was to be killed"
        print(f"  killed. machine 1's local_dir: {listing(out / 'machine-1')}{after_kill(out)}")
        print(f"  on the remote: steps {remote_steps(out / 'peek', remote, endpoint)}")
        print(machine_2)
        second = machine("machine-2")
        print(resumed(second))
        if show_machine_2:
            print(f"  machine 2's local_dir: {listing(out / 'machine-2')}")
        reference = machine("reference", local=False)
        same = second["digest"] == reference["digest"]
        print(f"== resumed weights bit-identical to an uninterrupted run: {same}")
    return 0 if same else 1
