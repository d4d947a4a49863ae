"""Hostile checkpoints and bad input: loading runs no code a checkpoint chose unless told to, no path escapes, odd views keep their values."""

from __future__ import annotations

import argparse
import re
import sys
import collections
import datetime
import pathlib
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from persist_core.cli import main
from tests.support.hostile import RunsOnLoad
from tests.support.states import assert_state_equal


@pytest.fixture
def crafted(tmp_path):
    marker = tmp_path / "marker"
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        engine.save({"w": torch.ones(2), "evil": RunsOnLoad(marker)}, step=1).wait()
    return tmp_path / "ckpt", marker


def test_a_crafted_leaf_is_refused_by_default_naming_it_and_the_opt_in(crafted):
    root, marker = crafted
    with CheckpointReader(root) as reader:
        with pytest.raises(UnsafeCheckpointError, match=r"tests\.support\.hostile\.leave_marker.*weights_only=False"):
            reader.load()
        with pytest.raises(UnsafeCheckpointError):
            reader.load(into={"w": torch.zeros(2)})  # the resharding path too
    with CheckpointEngine(root) as engine, pytest.raises(UnsafeCheckpointError):
        engine.load()
    assert not marker.exists()


def test_weights_only_false_is_full_pickle_for_trusted_checkpoints(crafted):
    root, marker = crafted
    with CheckpointReader(root) as reader:
        assert reader.load(weights_only=False)["evil"] == "pwned"
    assert marker.read_text() == "ran"
    with CheckpointReader(root) as reader, pytest.raises(ConfigError, match="weights_only='no'"):
        reader.load(weights_only="no")


def test_persist_export_refuses_it_unless_told_and_inspect_never_unpickles(crafted, tmp_path):
    root, marker = crafted
    refused = CliRunner().invoke(main, ["export", str(root), "--to", str(tmp_path / "out.pt")])
    assert refused.exit_code != 0 and "--unsafe-pickle" in refused.output and not marker.exists()
    assert CliRunner().invoke(main, ["inspect", str(root)]).exit_code == 0 and not marker.exists()
    ok = CliRunner().invoke(main, ["export", str(root), "--to", str(tmp_path / "out.pt"), "--unsafe-pickle"])
    assert ok.exit_code == 0, ok.output
    assert marker.exists()


def test_the_lightning_plugin_refuses_it_under_torchs_default_and_weights_only_true(crafted):
    from lightning_persist import PersistCheckpointIO

    root, marker = crafted
    io = PersistCheckpointIO(local_dir=root)
    for weights_only in (None, True):
        with pytest.raises(UnsafeCheckpointError):
            io.load_checkpoint(root / "step-000000000001", weights_only=weights_only)
    assert not marker.exists()
    assert io.load_checkpoint(root / "step-000000000001", weights_only=False)["evil"] == "pwned"


TRAINING_LEAVES = {
    "python_rng": random.Random(3).getstate(),
    "numpy_rng": np.random.RandomState(3).get_state(),
    "numpy_scalar": np.float32(2.5),
    "numpy_array": np.arange(6).reshape(2, 3),
    "torch_rng_in_a_tuple": (torch.Generator().manual_seed(3).get_state(), "mt"),
    "size": torch.Size([2, 3]),
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "ordered": collections.OrderedDict(a=1),
    "default": collections.defaultdict(list, a=[1]),
    "deque_of_tensors": collections.deque([torch.arange(3)]),
    "counter": collections.Counter("aab"),
    "namespace": argparse.Namespace(lr=0.1, name="run"),
    "set": {1, 2}, "frozen": frozenset({"x"}), "bytes": b"\x00\x01", "complex": 1 + 2j, "slice": slice(1, 9, 2),
    "when": datetime.datetime(2026, 12, 1, 12, 0), "path": pathlib.Path("/tmp/x"),
}


@pytest.mark.parametrize("name", sorted(TRAINING_LEAVES))
def test_every_type_a_training_state_holds_loads_restricted(tmp_path, name):
    value = TRAINING_LEAVES[name]
    with CheckpointEngine(tmp_path) as engine:
        engine.save({"leaf": value}, step=1).wait()
        loaded = engine.load()["leaf"]
    if isinstance(value, np.ndarray):
        assert np.array_equal(loaded, value)
    elif name == "numpy_rng":
        assert loaded[0] == value[0] and np.array_equal(loaded[1], value[1]) and loaded[2:] == value[2:]
    elif name in ("deque_of_tensors", "torch_rng_in_a_tuple"):
        assert torch.equal(loaded[0], value[0]) and type(loaded) is type(value)
    else:
        assert loaded == value and type(loaded) is type(value)


def test_lightnings_attribute_dict_loads_restricted(tmp_path):
    from lightning.fabric.utilities.data import AttributeDict

    with CheckpointEngine(tmp_path) as engine:
        engine.save({"hparams": AttributeDict(lr=0.1)}, step=1).wait()
        assert_state_equal(dict(engine.load()["hparams"]), {"lr": 0.1})


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "rank-00000.safetensors\n", "x/rank-00000.safetensors",
                                  "manifest.json", ""])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_corrupt_and_load_falls_back(tmp_path, name):
    import json

    with CheckpointEngine(tmp_path) as engine:
        engine.save({"w": torch.ones(2)}, step=1).wait()
        engine.save({"w": torch.full((2,), 2.0)}, step=2).wait()
    path = tmp_path / "step-000000000002" / "manifest.json"
    body = json.loads(path.read_bytes())
    body.pop("manifest_crc32c")
    body["files"][0]["name"] = name
    body["tensors"][0]["file"] = name
    path.write_bytes(_rechecksummed(body))
    with CheckpointReader(tmp_path) as reader:
        assert torch.equal(reader.load()["w"], torch.ones(2))  # step 2 skipped as corrupt, step 1 loads
        with pytest.raises(Exception, match="not a shard name"):
            reader.load(2)


def _rechecksummed(body: dict) -> bytes:
    """``body`` as a manifest whose own checksum matches (what a crafted one would carry)."""
    import json

    import crc32c

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # a crafted tree may nest deeper than json's default allows writing
    try:
        raw = json.dumps(body, separators=(",", ":")).encode()
    finally:
        sys.setrecursionlimit(limit)
    return raw[:-1] + f',"manifest_crc32c":{crc32c.crc32c(raw)}}}'.encode()


def test_conj_and_neg_views_sharing_storage_load_with_their_own_values(tmp_path):
    c = torch.tensor([1 + 2j, 3 - 4j])
    x = torch.tensor([1.0, -2.0])
    state = {"a": c, "b": c.conj(), "x": x, "y": torch._neg_view(x)}
    with CheckpointEngine(tmp_path) as engine:
        engine.save(state, step=1).wait()
        loaded = engine.load()
    assert torch.equal(loaded["b"], torch.tensor([1 - 2j, 3 + 4j])) and torch.equal(loaded["a"], c)
    assert torch.equal(loaded["y"], torch.tensor([-1.0, 2.0])) and torch.equal(loaded["x"], x)


def _engine(**kw):
    return lambda d: CheckpointEngine(d, **kw)


BAD_INPUTS = {  # each must be a ConfigError at the call that received it, naming the value
    "local_dir=None": (lambda d: CheckpointEngine(None), "local_dir=None"),
    "local_dir=URL": (lambda d: CheckpointEngine("s3://bucket/run"), "is a URL"),
    "remote_url=123": (_engine(remote_url=123), "remote_url=123"),
    "remote_url=''": (_engine(remote_url=""), "remote_url=''"),
    "remote_url='s3://'": (_engine(remote_url="s3://"), "names no bucket"),
    "storage_options='x'": (_engine(remote_url="memory://x", storage_options="key=SECRET"), "storage_options (a str)"),
    "collectives='x'": (_engine(collectives="x"), "collectives='x'"),
    "verify='no'": (_engine(verify="no"), "verify='no'"),
    "reader verify='no'": (lambda d: CheckpointReader(d, verify="no"), "verify='no'"),
    "plugin max_pending=0": (lambda d: _plugin(d, max_pending=0), "max_pending=0"),
    "plugin write_threads=0": (lambda d: _plugin(d, write_threads=0), "write_threads=0"),
    "plugin remote_url='nosuch://x'": (lambda d: _plugin(d, remote_url="nosuch://x"), "nosuch"),
    "hook preemption_signals=SIGTERM": (lambda d: _hook(d, preemption_signals=__import__("signal").SIGTERM),
                                        "must be a tuple"),
    "hook register(object())": (lambda d: _hook(d).register(object()), "needs an accelerate.Accelerator"),
}


def _plugin(d, **kw):
    from lightning_persist import PersistCheckpointIO

    return PersistCheckpointIO(local_dir=d, **kw)


def _hook(d, **kw):
    from accelerate_persist import PersistHook

    return PersistHook(local_dir=d, **kw)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_bad_argument_is_a_config_error_naming_it(tmp_path, case):
    make, named = BAD_INPUTS[case]
    with pytest.raises(ConfigError, match=re.escape(named)) as caught:
        make(tmp_path)
    assert "SECRET" not in str(caught.value)  # a bad value that may hold credentials is never printed


def test_bad_save_arguments_fail_at_the_call_and_leave_the_engine_usable(tmp_path):
    from persist_core import UnsupportedStateError

    deep = cur = {}
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    with CheckpointEngine(tmp_path) as engine:
        with pytest.raises(ConfigError, match="metadata='str'"):
            engine.save({"w": torch.ones(1)}, step=1, metadata="str")
        with pytest.raises(ConfigError, match="cannot be written as JSON"):
            engine.save({"w": torch.ones(1)}, step=1, metadata={"f": object()})
        with pytest.raises(UnsupportedStateError, match="recursion limit"):
            engine.save(deep, step=1)
        engine.save({"w": torch.ones(1)}, step=1).wait()  # the same step: nothing was reserved by the bad calls
        engine.wait()
    assert [c.step for c in CheckpointReader(tmp_path).list()] == [1]


def test_cli_bad_input_is_a_usage_error_not_a_traceback(crafted, tmp_path):
    root, _ = crafted
    bad_json = CliRunner().invoke(main, ["--storage-options", '["SECRET"]', "ls", str(root)])
    assert bad_json.exit_code == 2 and "must be a JSON object" in bad_json.output and "SECRET" not in bad_json.output
    nowhere = CliRunner().invoke(main, ["export", str(root), "--to", "/nonexistent-dir/x.pt"])
    assert nowhere.exit_code == 2 and "does not exist" in nowhere.output and "Traceback" not in nowhere.output


def _deep_tree(levels: int) -> dict:
    node: dict = {"tensor": 0}
    for _ in range(levels):
        node = {"list": [node]}
    return node


def _set(path: tuple, value):
    def mutate(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _shared(body: dict) -> dict:
    return next(t for t in body["tensors"] if t.get("stride") is not None)


def _whole(body: dict) -> dict:
    return next(t for t in body["tensors"] if t.get("stride") is None and t["dtype"] == "float32")


CRAFTED = {  # a crafted manifest carries a correct checksum: each must be corrupt by name, and load() fall back
    "dtype swapped, same size": lambda b: _whole(b).update(dtype="int32"),
    "dtype unknown": lambda b: _whole(b).update(dtype="nosuch"),
    "dtype not a string": lambda b: _whole(b).update(dtype=7),
    "shape negative": lambda b: _whole(b).update(shape=[-1]),
    "shape a string": lambda b: _whole(b).update(shape="x"),
    "shape grown": lambda b: _whole(b).update(shape=[4096, 4096]),
    "record not an object": _set(("tensors", 0), 5),
    "record without entry": lambda b: _whole(b).pop("entry"),
    "shared view past its entry": lambda b: _shared(b).update(offset=10 ** 6 * 4),
    "shared offset not aligned": lambda b: _shared(b).update(offset=2),
    "stride of the wrong length": lambda b: _shared(b).update(stride=[1]),
    "tree names a string index": _set(("tree",), {"tensor": "0"}),
    "tree pair of one": _set(("tree",), {"dict": [[{"value": "a"}]]}),
    "tree node of unknown kind": _set(("tree",), {"bogus": 1}),
    "tree value an object": _set(("tree",), {"value": {"a": 1}}),
    "tree deeper than the recursion limit": _set(("tree",), _deep_tree(5000)),
    "object at a negative offset": _set(("objects",), [["rank-00000.safetensors", -5, 3]]),
    "object in an unlisted file": _set(("objects",), [["rank-00009.safetensors", 0, 3]]),
    "file without checksums": lambda b: b["files"][0].update(chunks=[]),
    "file of negative size": lambda b: b["files"][0].update(size=-1),
    "files not a list": _set(("files",), "x"),
    "world of zero": _set(("world_size",), 0),
    "step a string": _set(("step",), "two"),
    "per_rank for a world it lacks": _set(("per_rank",), [[], [], []]),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_manifest_is_corrupt_by_name_and_load_falls_back(tmp_path, case):
    import json

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with CheckpointEngine(tmp_path) as engine:
        engine.save({"w": torch.ones(8), "t": base, "v": base[1:, ::2], "n": "one"}, step=1).wait()
        twice = base * 2
        engine.save({"w": torch.full((8,), 2.0), "t": twice, "v": twice[1:, ::2], "n": "two"}, step=2).wait()
    path = tmp_path / "step-000000000002" / "manifest.json"
    body = json.loads(path.read_bytes())
    body.pop("manifest_crc32c")
    CRAFTED[case](body)
    path.write_bytes(_rechecksummed(body))
    with CheckpointReader(tmp_path) as reader:
        with pytest.raises(CorruptCheckpointError):
            reader.load(2)
        assert reader.load()["n"] == "one"  # step 2 skipped, step 1 loads
        targets = {"w": torch.zeros(8), "t": torch.zeros(3, 4)}
        assert reader.load(into=targets)["n"] == "one" and torch.equal(targets["w"], torch.ones(8))  # resharding path
