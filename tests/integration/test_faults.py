"""The fault-injection suite, sampled (``benchmarks/fault_sweep.py`` runs it long and prints the figures):
SIGKILL at random moments of save/commit/upload/prune, remote outages and connection resets through a
proxy in front of the moto server, bit flips of a manifest. Nothing lost, no wrong value loaded."""

from __future__ import annotations

import random

import pytest

from tests.support.faults import flip_trials, kill_trial, outage_trial


@pytest.mark.parametrize("seed", range(3))
def test_sigkill_at_a_random_moment_loses_nothing_on_either_tier(tmp_path, bucket, s3_options, seed):
    tally = kill_trial(tmp_path, f"s3://{bucket}/run", s3_options, seed)
    assert (tally.lost, tally.wrong, tally.leaks) == (0, 0, 0), tally.notes


@pytest.mark.parametrize("seed", range(2))
def test_outages_and_resets_at_random_steps_lose_nothing(tmp_path, bucket, proxy, monkeypatch, seed):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "2")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "10")
    monkeypatch.setenv("PERSIST_REMOTE_IO_TIMEOUT_S", "3")  # a connection the proxy left half-open costs 3 s, not 20
    tally = outage_trial(tmp_path, f"s3://{bucket}/run", proxy, seed)
    assert tally.faults > 0 and (tally.lost, tally.wrong) == (0, 0), tally.notes


def test_sampled_bit_flips_of_a_manifest_always_fall_back_and_never_load_wrong_values(tmp_path):
    from tests.support.faults import GOLDEN

    nbits = (GOLDEN / "v2-manifest.json").stat().st_size * 8
    tally = flip_trials(tmp_path, random.Random(11).sample(range(nbits), 400))
    assert tally.faults == 400 and (tally.lost, tally.wrong) == (0, 0), tally.notes[:5]
