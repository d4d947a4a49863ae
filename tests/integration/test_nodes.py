"""Several nodes, each with its own NVMe: 4 real gloo ranks on this machine, 2 simulated nodes (ranks that see
different ``local_dir`` s), the moto S3 server as the remote. No shared file system anywhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import nodes_child
from tests.support.moto_server import free_port
from tests.support.ranks import exit_codes

STEP30 = "step-000000000030"


def _spawn(*args) -> None:
    mp.spawn(nodes_child.run, args=(4, free_port(), *args), nprocs=4, join=True)


def _results(out: Path, phase: str) -> list[dict]:
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(4)]


def _entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


@pytest.fixture
def out(tmp_path):
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


def test_two_nodes_commit_their_own_files_the_remote_assembles_them_and_a_replaced_node_restores_from_it(
        tmp_path, out, bucket, s3_endpoint, s3_options, monkeypatch):
    import s3fs

    monkeypatch.setenv("PERSIST_TEST_S3", s3_endpoint)
    base, remote = tmp_path / "nvme", f"s3://{bucket}/run"
    _spawn(str(base), remote, str(out), "save", False)
    saved = _results(out, "save")

    # each node's disk holds its own ranks' files and a manifest that says which node it is; retention
    # (keep_last=1) removed the same steps on both nodes
    for n, ranks in enumerate(([0, 1], [2, 3])):
        node = base / f"node{n}"
        assert _entries(node) == [STEP30], _entries(node)
        assert _entries(node / STEP30) == ["manifest.json", *(f"rank-{r:05d}.safetensors" for r in ranks)]
        manifest = json.loads((node / STEP30 / "manifest.json").read_text())
        assert manifest["version"] == 7 and manifest["nodes"] == [[0, 1], [2, 3]] and manifest["node"] == n
        assert len(manifest["files"]) == 4
        # each node's record of what is not uploaded yet, for persist gc there: nothing, at the end
        assert json.loads((node / ".unsynced.json").read_text())["steps"] == []
    # the remote holds the whole checkpoint, its manifest placing every file there
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    for step in (10, 20, 30):
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/run/step-{step:012d}"))
        assert names == ["manifest.json", *(f"rank-{r:05d}.safetensors" for r in range(4)), "store-checksums.json"], \
            (step, names)
        # the store's checksum of every rank's file, the other node's included, recorded before the manifest
        recorded = json.loads(fs.cat(f"{bucket}/run/step-{step:012d}/store-checksums.json"))["objects"]
        assert sorted(recorded) == names[1:5] and all(o["algorithm"] == "CRC32" for o in recorded.values())
    remote_manifest = json.loads(fs.cat(f"{bucket}/run/{STEP30}/manifest.json"))
    assert remote_manifest["node"] is None and remote_manifest["nodes"] == [[0, 1], [2, 3]]

    # every rank restored step 30 whole: its node's files from disk, the other node's from the remote
    for r, res in enumerate(saved):
        assert res["step"] == 30 and res["equal"], (r, res)
        assert torch.equal(res["rng"], torch.tensor([r * 10 + 30]))
        assert res["remote_bytes"] > 0  # the other node's part of the replicated tensors and of the DTensor

    # persist verify on one node's directory: its files verify, the other node's are named, not "corrupt"
    done = subprocess.run([sys.executable, "-m", "persist_core.cli", "verify", str(base / "node1")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 30: OK" in done.stdout and "rank-00000.safetensors" in done.stdout and "other nodes" in done.stdout

    # node 1 is replaced (its disk is empty): its ranks stream what they need from the remote, node 0's
    # ranks read their own shards from disk; all resume from the same step
    shutil.rmtree(base / "node1")
    _spawn(str(base), remote, str(out), "resume", False)
    resumed = _results(out, "resume")
    for r, res in enumerate(resumed):
        assert res["step"] == 30 and res["equal"] and res["in_place"], (r, res)
        assert torch.equal(res["rng"], torch.tensor([r * 10 + 30]))
    names = [f"rank-{r:05d}.safetensors" for r in range(4)]
    for r, res in enumerate(resumed):
        fetched = res["remote_files"]
        if r < 2:  # node 0's ranks: their own node's files from disk; only node 1's from the remote
            assert set(fetched) <= set(names[2:]) and res["remote_bytes"] > 0, (r, fetched)
        else:  # node 1's ranks: everything they needed from the remote, their own part included
            assert names[r] in fetched and fetched[names[r]] >= nodes_child.ROWS * nodes_child.COLS, (r, fetched)
    assert not (base / "node1" / STEP30).exists()  # streamed into the targets, nothing downloaded whole

    # the remote lost step 30 (say its upload never finished): node 0 still has it, node 1 cannot get it, so
    # every rank resumes from step 20, the newest all of them can get
    fs.rm(f"{bucket}/run/{STEP30}/manifest.json")
    _spawn(str(base), remote, str(out), "resume", False)
    for r, res in enumerate(_results(out, "resume")):
        assert res["step"] == 20 and res["equal"], (r, res)
        assert torch.equal(res["rng"], torch.tensor([r * 10 + 20]))


def test_two_nodes_with_compression_and_a_key_store_nothing_readable_and_a_replaced_node_restores_bit_exact(
        tmp_path, out, bucket, s3_endpoint, s3_options, monkeypatch):
    """The remote codec on (zstd + remote_encryption_key, the key a callable each rank resolves): each node uploads
    its own ranks' files encoded, rank 0's envelope takes their layouts from the sealed ``<file>.blocks`` records,
    and nothing of the state is readable in the bucket."""
    import s3fs

    monkeypatch.setenv("PERSIST_TEST_S3", s3_endpoint)
    base, remote = tmp_path / "nvme", f"s3://{bucket}/run"
    _spawn(str(base), remote, str(out), "save", False, True)
    for r, res in enumerate(_results(out, "save")):
        assert res["step"] == 30 and res["equal"] and res["remote_bytes"] > 0, (r, res)
        assert torch.equal(res["rng"], torch.tensor([r * 10 + 30]))

    # no tensor byte, no safetensors header, in any object of the remote (a known 64-byte run of every tensor)
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    objects = {p: fs.cat_file(p) for p in fs.find(f"{bucket}/run")}
    names = sorted(p.rsplit("/", 1)[1] for p in objects if f"/{STEP30}/" in p)
    assert names == sorted(["manifest.json", "store-checksums.json", *(f"rank-{r:05d}.safetensors" for r in range(4)),
                            *(f"rank-{r:05d}.safetensors.blocks" for r in range(4))]), names
    patterns = [b'"dtype"', b"fsdp"]
    for step in (10, 20, 30):
        for t in nodes_child.full_values(step).values():
            raw = t.numpy().tobytes()
            patterns += [raw[:64], raw[len(raw) // 2:len(raw) // 2 + 64]]
    for path, body in objects.items():
        assert not any(p in body for p in patterns), path

    # node 1 is replaced: its ranks decode what they need from the remote, node 0's read their disk; bit-exact
    shutil.rmtree(base / "node1")
    _spawn(str(base), remote, str(out), "resume", False, True)
    for r, res in enumerate(_results(out, "resume")):
        assert res["step"] == 30 and res["equal"] and res["in_place"], (r, res)
        assert torch.equal(res["rng"], torch.tensor([r * 10 + 30]))
        if r >= 2:
            assert f"rank-{r:05d}.safetensors" in res["remote_files"], (r, res["remote_files"])
    assert not (base / "node1" / STEP30).exists()


def test_a_failure_on_one_node_commits_nothing_on_any_node_and_one_shared_local_dir_still_commits_one_checkpoint(
        tmp_path, out):
    """Two independent runs, one after the other in one start of the 4 ranks (each start imports torch 4 times):
    rank 3 failing its write on two nodes, then every rank on one shared directory."""
    failing, shared = tmp_path / "nvme-fail", tmp_path / "nvme-shared"
    mp.spawn(nodes_child.runs, args=(4, free_port(), [(str(failing), "", str(out), "fail", False),
                                                      (str(shared), "", str(out), "save", True)]),
             nprocs=4, join=True)

    # a failure on one node commits nothing on any node
    results = _results(out, "fail")
    for r, res in enumerate(results):
        assert res["outcome"].startswith(("WriteError", "PersistError")), (r, res)
    assert "rank 3" in results[0]["outcome"] and "No space left" in results[0]["outcome"]
    for n in (0, 1):
        assert _entries(failing / f"node{n}") == ["step-000000000010"], _entries(failing / f"node{n}")

    # one shared local_dir for every rank still commits one checkpoint
    for r, res in enumerate(_results(out, "save")):
        assert res["step"] == 30 and res["equal"] and res["remote_bytes"] == 0, (r, res)
    node = shared / "node0"
    assert _entries(node) == [STEP30]
    manifest = json.loads((node / STEP30 / "manifest.json").read_text())
    assert manifest["nodes"] == [] and manifest["node"] is None and len(manifest["files"]) == 4


def test_a_rank_sigkilled_mid_save_commits_nothing_anywhere_and_the_others_do_not_hang(tmp_path, out):
    base = tmp_path / "nvme"
    assert exit_codes(nodes_child.kill, 4, str(base), str(out)) == [0, 0, 0, -9]
    for r in range(3):
        outcome = torch.load(out / f"kill-rank{r}.pt")["outcome"]
        assert "step=20 was not committed" in outcome, (r, outcome)
    for n in (0, 1):
        node = base / f"node{n}"
        committed = [p.name for p in node.iterdir() if (p / "manifest.json").exists()]
        assert committed == ["step-000000000010"], committed
