"""A referenced checkpoint the remote lost (issue 53, item 6): its manifest, or its whole prefix (an S3 lifecycle
rule), is gone from the remote, so every checkpoint referencing it is corrupt there. A fresh machine's ``load()``
falls back to the newest checkpoint that reads whole, saying which it skipped and why; ``load(step)`` of a dependent
and ``persist verify`` name the missing step."""

from __future__ import annotations

import logging

import fsspec
import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CorruptCheckpointError
from persist_core.cli import main
from persist_core.format.manifest import Manifest
from tests.support.states import assert_state_equal

BASE = 1 << 16  # float32 elements of the frozen base: 256 KiB


def _state(step: int) -> dict:
    base = torch.randn(BASE, generator=torch.Generator().manual_seed(1234))  # frozen: referenced, never written again
    adapter = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
    return {"model": {"base": base, "adapter": adapter}, "optim": {"exp_avg": adapter * 0.1}, "step": step}


@pytest.fixture
def url(memory_url):
    return memory_url


@pytest.mark.parametrize("lost", ["manifest", "prefix"])
def test_a_dependent_of_a_referenced_checkpoint_the_remote_lost_is_corrupt_there(tmp_path, url, lost, caplog):
    with CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, full_every=3, direct_io="off") as engine:
        for step in range(1, 7):  # 1 full, 2 and 3 reference 1; 4 full, 5 and 6 reference 4
            engine.save(_state(step), step=step)
    fs, root = fsspec.core.url_to_fs(url)
    assert Manifest.from_bytes(fs.cat_file(f"{root}/step-{6:012d}/manifest.json"), where="m").depends_on() == {4}
    if lost == "manifest":
        fs.rm_file(f"{root}/step-{4:012d}/manifest.json")
    else:
        fs.rm(f"{root}/step-{4:012d}", recursive=True)

    with CheckpointEngine(tmp_path / "fresh", remote_url=url, incremental=True, direct_io="off") as engine:
        with caplog.at_level(logging.WARNING, logger="persist_core"):
            assert_state_equal(engine.load(), _state(3))  # 6 and 5 reference the lost 4: the newest whole is 3
        skipped = {r.getMessage() for r in caplog.records if "skipping" in r.getMessage()}
        assert any("[step=6]" in m and "step 4" in m for m in skipped), skipped
        assert any("[step=5]" in m and "step 4" in m for m in skipped), skipped
        with pytest.raises(CorruptCheckpointError, match="step 4"):
            engine.load(step=6)

    out = CliRunner().invoke(main, ["verify", url, "--step", "6"], catch_exceptions=False)
    assert out.exit_code == 1 and "references bytes of step 4" in out.output, out.output
    every = CliRunner().invoke(main, ["verify", url], catch_exceptions=False)
    assert every.exit_code == 1 and "step 5: BAD" in every.output and "step 3: OK" in every.output, every.output


@pytest.mark.parametrize("lost", ["manifest", "prefix"])
def test_pull_of_a_dependent_of_a_referenced_checkpoint_the_remote_lost_names_it_and_the_step_to_pull(tmp_path, url,
                                                                                                   lost):
    with CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, full_every=3, direct_io="off") as engine:
        for step in range(1, 7):  # 1 full, 2 and 3 reference 1; 4 full, 5 and 6 reference 4
            engine.save(_state(step), step=step)
    fs, root = fsspec.core.url_to_fs(url)
    if lost == "manifest":
        fs.rm_file(f"{root}/step-{4:012d}/manifest.json")
    else:
        fs.rm(f"{root}/step-{4:012d}", recursive=True)

    here = str(tmp_path / "here")
    for asked in (["--step", "6"], []):  # the step asked for, and the newest
        out = CliRunner().invoke(main, ["pull", url, here, *asked])
        assert out.exit_code == 2, out.output
        assert "step 6 references step 4" in out.output and "--step 3" in out.output, out.output
        assert "Traceback" not in out.output and "RemoteError" not in out.output, out.output
    out = CliRunner().invoke(main, ["pull", url, here, "--step", "3"], catch_exceptions=False)
    assert out.exit_code == 0, out.output  # the fix the message names works
    with CheckpointEngine(here, incremental=True, direct_io="off") as engine:
        assert_state_equal(engine.load(), _state(3))
