"""Bad inputs are a ConfigError at the call that received them (the CLI: a usage error, exit 2), naming
the value and the fix, and nothing committed is lost (issue 40, item 4).

Each row was accepted before: it misbehaved later (a save that commits and then cannot be loaded, a
policy class that fails after every commit) or was kept silently (an id with a newline, options for a
remote that is not there). The real engine, reader and ``persist`` command; ``memory://`` remotes.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader, KeepLastN, PerRank
from persist_core._knobs import MAX_STEP
from persist_core.cli import main as persist
from persist_core.errors import ConfigError
from persist_core.policies.save import Continuous
from persist_core.config import Config
from tests.support.states import assert_state_equal


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def memory_url() -> str:
    return f"memory:///bad-inputs-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def saved(tmp_path) -> tuple[Path, str]:
    """``(local_dir, remote_url)`` holding steps 1 and 2 on both tiers."""
    url = memory_url()
    with CheckpointEngine(tmp_path / "ckpt", remote_url=url) as engine:
        for step in (1, 2):
            engine.save(state(step), step=step)
    return tmp_path / "ckpt", url


# ---------------------------------------------------------------- construction: the engine, the reader, adapters

MEMORY = "memory:///bad-inputs-ctor"
ENGINE_ARGS = [
    pytest.param(dict(torch_loadable="no"), "torch_loadable='no'", id="torch_loadable-str"),
    pytest.param(dict(torch_loadable=1), "torch_loadable=1", id="torch_loadable-int"),
    pytest.param(dict(keep_local=KeepLastN), "KeepLastN\\(", id="keep_local-class"),
    pytest.param(dict(keep_remote=KeepLastN, remote_url=MEMORY), "KeepLastN\\(", id="keep_remote-class"),
    pytest.param(dict(save_policy=Continuous), "Continuous\\(", id="save_policy-class"),
    pytest.param(dict(write_threads=10**6), "write_threads=1000000", id="write_threads-huge"),
    pytest.param(dict(run_id="a/b\n"), "run_id='a/b\\\\n'", id="run_id-slash-newline"),
    pytest.param(dict(run_id="a/b"), "run_id='a/b'", id="run_id-slash"),
    pytest.param(dict(run_id="x" * 300), "run_id=", id="run_id-long"),
    pytest.param(dict(storage_options={"anon": True}), "remote_url", id="storage_options-without-remote"),
    pytest.param(dict(remote_url="memory:///run\x00x"), "\\\\x00", id="remote_url-nul"),
    pytest.param(dict(remote_url="s3://bucket/run\n"), "\\\\n", id="remote_url-newline"),
    pytest.param(dict(clock=5), "clock=5", id="clock-not-callable"),
    pytest.param(dict(chunk_bytes=1 << 40), "chunk_bytes=1099511627776", id="chunk_bytes-huge"),
    pytest.param(dict(max_pending=10**6), "max_pending=1000000", id="max_pending-huge"),
]


@pytest.mark.parametrize("kwargs, names", ENGINE_ARGS)
def test_the_engine_refuses_a_bad_argument_at_construction(tmp_path, kwargs, names):
    with pytest.raises(ConfigError, match=names):
        CheckpointEngine(tmp_path / "ckpt", **kwargs)
    with CheckpointEngine(tmp_path / "ckpt") as engine:  # nothing held: the directory is usable at once
        engine.save(state(1), step=1)


def test_a_local_dir_with_a_nul_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="NUL"):
        CheckpointEngine(f"{tmp_path}/a\x00b")


@pytest.mark.parametrize("variable, value", [("PERSIST_WRITE_THREADS", "1000000"), ("PERSIST_RUN_ID", "a/b"),
                                             ("PERSIST_CHUNK_BYTES", str(1 << 40))])
def test_the_environment_is_checked_as_the_arguments_are(tmp_path, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        CheckpointEngine(tmp_path / "ckpt", remote_url=memory_url())


@pytest.mark.parametrize("kwargs, names", [
    pytest.param(dict(storage_options={"anon": True}), "remote_url", id="storage_options-without-remote"),
    pytest.param(dict(remote_url="memory:///run\x00x"), "\\\\x00", id="remote_url-nul"),
])
def test_the_reader_refuses_the_same_arguments(tmp_path, kwargs, names):
    with pytest.raises(ConfigError, match=names):
        CheckpointReader(tmp_path / "ckpt", **kwargs)


ADAPTER_ARGS = [
    pytest.param(dict(torch_loadable="no"), "torch_loadable='no'", id="torch_loadable-str"),
    pytest.param(dict(write_threads=10**6), "write_threads=1000000", id="write_threads-huge"),
    pytest.param(dict(storage_options={"anon": True}), "remote_url", id="storage_options-without-remote"),
    pytest.param(dict(remote_url="memory:///run\x00x"), "\\\\x00", id="remote_url-nul"),
    pytest.param(dict(retention=KeepLastN), "KeepLastN\\(", id="retention-class"),
    pytest.param(dict(save_policy=Continuous), "Continuous\\(", id="save_policy-class"),
    pytest.param(dict(preemption_signals=("SIGTERM",)), "'SIGTERM'", id="signal-by-name"),
    pytest.param(dict(preemption_signals=(signal.SIGKILL,)), "SIGKILL", id="signal-uncatchable"),
    pytest.param(dict(max_pending=10**6), "max_pending=1000000", id="max_pending-huge"),
]


@pytest.mark.parametrize("kwargs, names", ADAPTER_ARGS)
def test_every_adapters_options_refuse_them_in_one_place(tmp_path, kwargs, names):
    with pytest.raises(ConfigError, match=names):
        Config.from_keywords(tmp_path / "ckpt", **kwargs)


def test_options_without_a_local_dir_are_refused_by_name():
    with pytest.raises(ConfigError, match="local_dir=None"):
        Config.from_keywords(None)


def test_an_adapter_refuses_them_when_built(tmp_path):
    """PersistHook stands for the three adapters: PersistCheckpointIO and PersistTrainerCallback build the same
    Config (importing Lightning or transformers costs seconds)."""
    pytest.importorskip("accelerate")
    from accelerate_persist import PersistHook

    for kwargs, names in [(dict(storage_options={"anon": True}), "remote_url"), (dict(retention=KeepLastN), "KeepLastN"),
                          (dict(remote_url="memory:///run\x00x"), "x00"), (dict(save_policy=Continuous), "Continuous")]:
        with pytest.raises(ConfigError, match=names):
            PersistHook(tmp_path / "ckpt", **kwargs)


# ---------------------------------------------------------------- save(), load(), resume_from()

SAVES = [
    pytest.param(dict(state=state(3), step=2**70), str(2**70), id="step-2**70"),
    pytest.param(dict(state=state(3), step=MAX_STEP + 1), "MAX_STEP", id="step-past-the-largest"),
    pytest.param(dict(state=state(3), step=True), "step=True", id="step-bool"),
    pytest.param(dict(state=state(3), step=-1), "step=-1", id="step-negative"),
    pytest.param(dict(state={"r": PerRank(PerRank(1))}, step=3), "PerRank", id="perrank-in-perrank"),
    pytest.param(dict(state={"r": PerRank({"k": PerRank(1)})}, step=3), "PerRank", id="perrank-deeper"),
    pytest.param(dict(state=state(3), step=3, metadata={1: "x"}), "1", id="metadata-int-key"),
    pytest.param(dict(state=state(3), step=3, metadata={"a": {2.5: "x"}}), "2.5", id="metadata-nested-key"),
    pytest.param(dict(state=state(3), step=3, metadata={"shape": (3, 4)}), "(3, 4)", id="metadata-tuple"),
]


@pytest.mark.parametrize("kwargs, names", SAVES)
def test_save_refuses_a_bad_step_state_or_metadata_and_the_next_saves_go_on(saved, kwargs, names):
    local, url = saved
    with CheckpointEngine(local, remote_url=url) as engine:
        engine.load()  # the run goes on from step 2
        with pytest.raises(ConfigError, match=names):
            engine.save(**kwargs)
        engine.save(state(3), step=3).wait()  # the refused step was not taken as the newest
        assert [c.step for c in engine.list()] == [1, 2, 3]
        assert_state_equal(engine.load(), state(3))  # a default load still loads the newest


def test_the_largest_step_saves_and_loads(tmp_path):
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        engine.save(state(1), step=MAX_STEP)
        engine.wait()
        assert [c.step for c in engine.list()] == [MAX_STEP]
        assert engine.load()["step"] == 1


LOADS = [
    pytest.param(dict(step=True), "step=True", id="step-bool"),
    pytest.param(dict(step=-1), "step=-1", id="step-negative"),
    pytest.param(dict(step="1"), "step='1'", id="step-str"),
    pytest.param(dict(step=1.0), "step=1.0", id="step-float"),
    pytest.param(dict(into=5), "into=5", id="into-int"),
    pytest.param(dict(into="model"), "into='model'", id="into-str"),
    pytest.param(dict(verify="no"), "verify='no'", id="verify-str"),
    pytest.param(dict(map_location="nowhere"), "map_location='nowhere'", id="map_location-unknown"),
    pytest.param(dict(map_location="cuda:99"), "map_location='cuda:99'", id="map_location-no-such-gpu"),
]


@pytest.mark.parametrize("kwargs, names", LOADS)
def test_load_refuses_a_bad_argument_on_the_reader_and_the_engine(saved, kwargs, names):
    local, url = saved
    with CheckpointReader(local, remote_url=url) as reader:
        with pytest.raises(ConfigError, match=names):
            reader.load(**kwargs)
        assert_state_equal(reader.load(), state(2))
    with CheckpointEngine(local, remote_url=url) as engine:
        with pytest.raises(ConfigError, match=names):
            engine.load(**kwargs)
        assert engine.resumed_step is None  # no resume was taken from the bad call
        assert_state_equal(engine.load(), state(2))


def test_waits_and_decisions_refuse_what_is_not_a_timeout_or_a_step(tmp_path):
    with CheckpointEngine(tmp_path / "ckpt", save_policy=Continuous(), preemption=None) as engine:
        handle = engine.save(state(1), step=1)
        for timeout in (-1, "x", float("nan")):
            with pytest.raises(ConfigError, match="timeout="):
                engine.wait(timeout)
            with pytest.raises(ConfigError, match="timeout="):
                handle.wait(timeout)
        with pytest.raises(ConfigError, match="step=True"):
            engine.should_save(True)
        with pytest.raises(ConfigError, match="step=-1"):
            engine.maybe_save(lambda: state(2), step=-1)
        engine.wait()
        assert [c.step for c in engine.list()] == [1]


def test_fetch_refuses_a_bool_step_and_load_a_negative_rank(saved):
    local, url = saved
    with CheckpointReader(local.parent / "other", remote_url=url) as reader:
        with pytest.raises(ConfigError, match="step=True"):
            reader.fetch(True)
        with pytest.raises(ConfigError, match="rank=-1"):
            reader.load(rank=-1)


@pytest.mark.parametrize("step, names", [(99, "99.*1, 2"), (True, "step=True"), (-1, "step=-1")])
def test_resume_from_a_step_that_is_not_committed_is_refused_naming_those_that_are(saved, step, names):
    local, url = saved
    with CheckpointEngine(local, remote_url=url) as engine:
        with pytest.raises(ConfigError, match=names):
            engine.resume_from(step)
        assert engine.resumed_step is None
        engine.resume_from(1)  # a committed one is taken: a save of 2 branches from it
        engine.save(state(5), step=2)
        engine.wait()
        assert [a.step for a in engine.abandoned()] == [2] and engine.load(2)["step"] == 5


def test_resume_from_a_step_only_the_remote_holds(saved, tmp_path):
    _, url = saved
    with CheckpointEngine(tmp_path / "fresh", remote_url=url) as engine:
        engine.resume_from(2, from_remote=True)
        assert engine.resumed_step == 2


# ---------------------------------------------------------------- the persist command

@pytest.fixture
def cli_dir(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    with CheckpointEngine(d) as engine:
        for step in (1, 2):
            engine.save(state(step), step=step)
    return d


def _args(d: Path) -> dict[str, list[str]]:
    return {
        "cp-onto-itself": ["cp", str(d), str(d), "--step", "1"],
        "cp-onto-itself-as-url": ["cp", str(d), f"file://{d}/", "--step", "1"],
        "sync-onto-itself": ["sync", str(d), f"{d}/"],
        "sync-onto-itself-by-another-name": ["sync", str(d), f"{d}/../{d.name}"],
        "gc-nan-age": ["gc", str(d), "--keep-last", "1", "--incomplete-older-than", "nan"],
        "stats-negative-rows": ["stats", str(d), "--last", "-1"],
        "ls-zero-milestones": ["ls", str(d), "--milestones", "0"],
        "ls-negative-milestones": ["ls", str(d), "--milestones", "-5"],
        "inspect-negative-step": ["inspect", str(d), "--step", "-1"],
        "inspect-negative-depth": ["inspect", str(d), "--depth", "-1"],
        "rm-negative-step": ["rm", str(d), "--step", "-1"],
        "export-negative-step": ["export", str(d), "--step", "-1", "--to", f"{d.parent}/out.pt"],
        "gc-keep-none": ["gc", str(d), "--keep-last", "0"],
        "gc-nan-seconds": ["gc", str(d), "--keep-every-n-seconds", "nan"],
        "push-onto-itself": ["push", str(d), f"file://{d}"],
        "pull-onto-itself": ["pull", f"file://{d}", str(d)],
    }


NAMES = {"cp-onto-itself": "itself", "cp-onto-itself-as-url": "itself", "sync-onto-itself": "itself",
         "sync-onto-itself-by-another-name": "itself", "gc-nan-age": "nan", "stats-negative-rows": "-1",
         "ls-zero-milestones": "0", "ls-negative-milestones": "-5", "inspect-negative-step": "-1",
         "inspect-negative-depth": "-1", "rm-negative-step": "-1", "export-negative-step": "-1", "gc-keep-none": "0",
         "gc-nan-seconds": "nan", "push-onto-itself": "itself", "pull-onto-itself": "itself"}


@pytest.mark.parametrize("case", list(NAMES))
def test_the_cli_refuses_a_bad_argument_with_a_usage_error_and_removes_nothing(cli_dir, case):
    done = CliRunner().invoke(persist, _args(cli_dir)[case])
    assert done.exit_code == 2, done.output
    assert NAMES[case] in done.output
    assert "Traceback" not in done.output
    with CheckpointReader(cli_dir) as reader:
        assert [c.step for c in reader.list()] == [1, 2]
        assert_state_equal(reader.load(1), state(1))


def test_cp_between_two_memory_names_of_one_location_is_refused(tmp_path):
    url = memory_url()
    with CheckpointEngine(tmp_path / "ckpt", remote_url=url) as engine:
        engine.save(state(1), step=1)
    done = CliRunner().invoke(persist, ["cp", url, url + "/", "--step", "1"])
    assert done.exit_code == 2 and "itself" in done.output, done.output
    with CheckpointReader(tmp_path / "other", remote_url=url) as reader:
        assert [c.step for c in reader.list("remote")] == [1]


def test_export_of_a_local_directory_takes_global_s3_options(cli_dir, tmp_path):
    done = CliRunner().invoke(persist, ["export", str(cli_dir), "--to", str(tmp_path / "out.pt"),
                                        "--endpoint-url", "http://127.0.0.1:1"])
    assert done.exit_code == 0, done.output
    assert torch.load(tmp_path / "out.pt")["step"] == 2
