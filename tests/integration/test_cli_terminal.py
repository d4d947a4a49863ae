"""The ``persist`` command as a person meets it: on a terminal (a pseudo-terminal) while it transfers, and its reports."""

from __future__ import annotations

import os
import pty
import sys
from pathlib import Path

import torch

from persist_core import CheckpointEngine


def on_terminal(*args: str) -> str:
    """Run ``persist ARGS`` with a pseudo-terminal as its stdout and stderr; everything it wrote."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the same interpreter, the repository importable
        os.environ["PYTHONPATH"] = str(Path(__file__).parents[2])
        os.execv(sys.executable, [sys.executable, "-c", "from persist_core.cli import main; main()", *args])
    out = b""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_push_on_a_terminal_shows_its_bar_and_each_line_without_markup_tags(tmp_path):
    with CheckpointEngine(tmp_path / "local") as engine:
        for step in (1, 2):
            engine.save({"w": torch.ones(1 << 18)}, step=step)
    out = on_terminal("push", str(tmp_path / "local"), f"file://{tmp_path}/remote")
    assert "step 2 -> " in out and "pushed 2 checkpoints" in out
    assert "[progress.description]" not in out


def test_du_gives_every_kind_the_same_keys_locally_and_on_a_remote(tmp_path):
    import json

    from click.testing import CliRunner

    from persist_core.cli import main as cli

    remote = f"memory://{tmp_path}/remote"  # an fsspec URL, as s3:// is
    with CheckpointEngine(tmp_path / "local", remote_url=remote) as engine:
        engine.save({"w": torch.ones(8)}, step=1)
    reports = [json.loads(CliRunner().invoke(cli, ["du", where, "--json"], catch_exceptions=False).output)
               for where in (str(tmp_path / "local"), remote)]
    assert reports[0].keys() == reports[1].keys() >= {"full", "weights-only", "bytes"}
    assert reports[0]["weights-only"] == {"checkpoints": 0, "bytes": 0, "referencing": 0, "shared_bytes": 0} == \
        reports[1]["weights-only"]
