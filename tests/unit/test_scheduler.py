"""Save-decision policies (tables, a fake clock, no sleeps), maybe_save, and the preemption notice."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from persist_core import (
    AnyOf,
    CheckpointEngine,
    CheckpointReader,
    ConfigError,
    Continuous,
    DecisionContext,
    EveryNSeconds,
    EveryNSteps,
    KeepLastN,
    OptimalInterval,
)
from persist_core.layout import HISTORY_NAME
from tests.support.states import assert_state_equal
from tests.support.fakes import FakeClock, GatedOps, TwoRanksWithoutDecisions
from tests.support import states

ROOT = Path(__file__).resolve().parents[2]


def ctx(step=10, now=100.0, last_step=None, last_time=None, in_flight=False, cost_s=None, commit_s=None,
        slowdown=None, idle_needed=0, resumed_time=None):
    return DecisionContext(step=step, now=now, last_step=last_step, last_time=last_time, in_flight=in_flight,
                           cost_s=cost_s, commit_s=commit_s, slowdown=slowdown, idle_needed=idle_needed,
                           resumed_time=resumed_time)


@pytest.mark.parametrize("policy, context, expected", [
    (EveryNSteps(5), ctx(step=10), True),
    (EveryNSteps(5), ctx(step=11), False),
    (EveryNSeconds(30), ctx(), True),  # never saved: save now
    (EveryNSeconds(30), ctx(now=129.0, last_time=100.0), False),
    (EveryNSeconds(30), ctx(now=130.0, last_time=100.0), True),
    (Continuous(), ctx(now=100.0, last_time=99.9), True),
    (Continuous(), ctx(in_flight=True), False),  # never a second save in flight
    (Continuous(min_interval_s=30), ctx(now=120.0, last_time=100.0), False),
    (Continuous(min_interval_s=30), ctx(now=131.0, last_time=100.0), True),
    (OptimalInterval(mtbf_s=3600), ctx(), True),  # nothing measured yet
    # sqrt(2 * 0.5 s * 3600 s) = 60 s
    (OptimalInterval(mtbf_s=3600), ctx(now=159.0, last_time=100.0, cost_s=0.5, commit_s=2.0), False),
    (OptimalInterval(mtbf_s=3600), ctx(now=160.5, last_time=100.0, cost_s=0.5, commit_s=2.0), True),
    (OptimalInterval(mtbf_s=3600), ctx(now=1000.0, last_time=100.0, cost_s=0.5, in_flight=True), False),
    # a resumed process before its first save: the interval counts from the load
    (OptimalInterval(mtbf_s=3600), ctx(now=159.0, resumed_time=100.0, cost_s=0.5, commit_s=2.0), False),
    (OptimalInterval(mtbf_s=3600), ctx(now=160.5, resumed_time=100.0, cost_s=0.5, commit_s=2.0), True),
    (EveryNSeconds(30), ctx(now=110.0, resumed_time=100.0), True),  # the others as documented: at the first point
    # the slowdown not measured yet: decision points with no save in flight first, then the interval
    (OptimalInterval(mtbf_s=3600), ctx(now=1000.0, last_time=100.0, cost_s=0.5, idle_needed=3), False),
    (OptimalInterval(mtbf_s=3600), ctx(now=1000.0, last_time=100.0, cost_s=0.5, idle_needed=3, slowdown=0.1), True),
    (AnyOf(EveryNSteps(1000), Continuous(min_interval_s=60)), ctx(step=1000, in_flight=True), True),
    (AnyOf(EveryNSteps(1000), Continuous(min_interval_s=60)), ctx(step=999, now=150.0, last_time=100.0), False),
])
def test_policy_table(policy, context, expected):
    assert policy.should_save(context) is expected


def test_optimal_interval_follows_the_measured_cost():
    policy = OptimalInterval(mtbf_s=7200)
    assert policy.interval_s(ctx(cost_s=0.25)) == pytest.approx(math.sqrt(2 * 0.25 * 7200))
    assert policy.interval_s(ctx(cost_s=1.0, commit_s=500.0)) == 500.0  # never faster than a save commits


@pytest.mark.parametrize("make, message", [
    (lambda: EveryNSteps(0), "n must be an int >= 1"),
    (lambda: EveryNSeconds(-1), "seconds must be a positive number"),
    (lambda: Continuous(min_interval_s=-5), "non-negative"),
    (lambda: OptimalInterval(mtbf_s=0), "mtbf_s must be a positive number"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_policy_kinds_do_not_mix(tmp_path):
    with pytest.raises(ConfigError, match="save-decision"):
        CheckpointEngine(tmp_path, save_policy=KeepLastN(3))
    with pytest.raises(ConfigError, match="retention policy"):
        CheckpointEngine(tmp_path, keep_local=AnyOf(EveryNSteps(3)))
    with pytest.raises(ConfigError, match="needs CheckpointEngine"):
        CheckpointEngine(tmp_path / "x").maybe_save(dict, step=1)


state_for = states.state_for


def test_continuous_never_has_two_saves_in_flight_and_keeps_its_interval(tmp_path):
    clock, ops, built = FakeClock(), GatedOps(open_gate=True), []

    def make(step):
        return lambda: built.append(step) or state_for(step)

    with CheckpointEngine(tmp_path, save_policy=Continuous(min_interval_s=10), clock=clock, file_ops=ops) as engine:
        ops.gate.clear()
        assert engine.maybe_save(make(1), step=1) is not None  # the first decision point saves
        clock.now += 60
        for step in (2, 3, 4):  # step 1 is still being written: no second save, no state built
            assert engine.maybe_save(make(step), step=step) is None
        ops.gate.set()
        engine.wait()
        assert engine.maybe_save(make(5), step=5) is not None
        engine.wait()
        clock.now += 9  # committed, but the minimum interval has not passed
        assert engine.maybe_save(make(6), step=6) is None
        clock.now += 1
        assert engine.maybe_save(make(7), step=7) is not None
        assert engine.maybe_save(make(7), step=7) is None  # a step is saved once
    assert built == [1, 5, 7]
    assert [c.step for c in CheckpointReader(tmp_path).list()] == [1, 5, 7]


def test_optimal_interval_uses_the_cost_of_the_saves_it_measured(tmp_path):
    clock = FakeClock()
    policy = OptimalInterval(mtbf_s=3600)
    with CheckpointEngine(tmp_path, save_policy=policy, clock=clock) as engine:
        engine.maybe_save(lambda: state_for(1), step=1).wait()
        context = engine.decision_context(2)
        assert context.cost_s is not None and context.cost_s > 0
        step = 2
        while engine.decision_context(step).idle_needed:  # steps without a save first: the slowdown measured
            assert engine.maybe_save(lambda: state_for(step), step=step) is None
            step += 1
        assert step == 8  # five idle gaps after the one that straddles the commit
        context = engine.decision_context(step)
        interval = policy.interval_s(context)
        clock.now = context.last_time + interval * 0.9
        assert engine.maybe_save(lambda: state_for(step), step=step) is None
        clock.now = context.last_time + interval * 1.1
        assert engine.maybe_save(lambda: state_for(step + 1), step=step + 1) is not None


CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from persist_core import CheckpointEngine, EveryNSteps, PreemptionNotice
engine = CheckpointEngine({local!r}, remote_url={remote!r}, save_policy=EveryNSteps(1000), preemption=PreemptionNotice())
for step in range(1, 10_000):
    w = torch.full((256, 256), float(step))
    if step == 37:
        os.kill(os.getpid(), signal.SIGTERM)  # the notice arrives mid-step
    engine.maybe_save(lambda: {{"w": w, "step": step}}, step=step)
    if engine.preempted:
        print(step, flush=True)
        break
engine.close()
"""


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_a_preemption_notice_saves_the_step_it_arrived_at_and_syncs_it(tmp_path):
    local, remote = tmp_path / "ckpt", (tmp_path / "remote").as_uri()
    child = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), local=str(local), remote=remote)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "37"
    fresh = CheckpointEngine(tmp_path / "fresh", remote_url=remote)
    assert [c.step for c in fresh.list("remote")] == [37]  # committed and uploaded before the exit
    assert_state_equal(fresh.load(37), {"w": torch.full((256, 256), 37.0), "step": 37})


DEFAULT_CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from persist_core import CheckpointEngine, EveryNSteps
engine = CheckpointEngine({local!r}, remote_url={remote!r}, save_policy=EveryNSteps(1000))  # no notice passed
for step in range(1, 10_000):  # a loop that never looks at engine.preempted
    w = torch.full((256, 256), float(step))
    if step == 37:
        os.kill(os.getpid(), signal.SIGTERM)
    engine.maybe_save(lambda: {{"w": w, "step": step}}, step=step)
    print(step, flush=True)
print("never here", flush=True)
"""


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_with_a_save_policy_sigterm_saves_that_step_syncs_it_and_ends_the_process_as_sigterm_would(tmp_path):
    local, remote = tmp_path / "ckpt", (tmp_path / "remote").as_uri()
    child = subprocess.run([sys.executable, "-c", DEFAULT_CHILD.format(root=str(ROOT), local=str(local), remote=remote)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGTERM, child.stderr[-3000:]  # what a scheduler expects to see
    assert child.stdout.split()[-1] == "36"  # step 37's maybe_save saved, flushed, then the process ended
    fresh = CheckpointEngine(tmp_path / "fresh", remote_url=remote)
    assert [c.step for c in fresh.list("remote")] == [37]
    assert_state_equal(fresh.load(37), {"w": torch.full((256, 256), 37.0), "step": 37})


def test_the_default_notice_is_installed_only_with_a_policy_and_put_back_at_close(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointEngine(tmp_path / "a"):
        assert signal.getsignal(signal.SIGTERM) is before  # no policy: nothing installed
    with CheckpointEngine(tmp_path / "b", save_policy=EveryNSteps(10)):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    with CheckpointEngine(tmp_path / "c", save_policy=EveryNSteps(10), preemption=None):
        assert signal.getsignal(signal.SIGTERM) is before


def test_summary_reports_intervals_and_the_stall_fraction(tmp_path):
    from persist_core.history import describe_summary

    clock = FakeClock()
    with CheckpointEngine(tmp_path, clock=clock) as engine:
        assert engine.summary()["interval_p50_s"] is None
        for step, advance in ((1, 0), (5, 10), (9, 10), (13, 40)):
            clock.now += advance
            engine.save(state_for(step), step=step).wait()
        clock.now += 40
        summary = engine.summary()
    assert summary["saves"] == 4
    assert (summary["interval_p50_s"], summary["interval_p90_s"], summary["interval_p50_steps"]) == (10, 40, 4)
    assert 0 < summary["stall_fraction"] < 1  # real stalls over 100 fake seconds
    assert "interval P50 10.0 s / P90 40.0 s (4 steps)" in describe_summary(summary)


def test_maybe_save_across_ranks_needs_a_decision_channel(tmp_path):
    engine = CheckpointEngine(tmp_path, collectives=TwoRanksWithoutDecisions(), save_policy=EveryNSteps(1))
    built = []
    with pytest.raises(ConfigError, match="decision channel.*TorchCollectives.new_group"):
        engine.maybe_save(lambda: built.append(1), step=1)
    assert built == [] and engine.list() == []
    engine.close()


def test_slowdown_meter_compares_gaps_while_writing_with_gaps_while_idle():
    from persist_core.history import SlowdownMeter

    meter = SlowdownMeter(min_samples=3)
    now = 0.0
    for step in range(1, 5):  # idle: 1 s from point to point
        now += 1.0
        meter.observe(step, now, writing=False)
    assert meter.slowdown() is None  # nothing measured while writing yet
    meter.observe(4, now + 0.1, writing=False)  # the same step twice adds no gap
    meter.staged(4, now + 0.3)  # a save returned at 4 (its stall is not a gap)
    now += 0.3
    for step in range(5, 9):  # writing: 1.5 s from point to point
        now += 1.5
        meter.observe(step, now, writing=True)
    now += 7.0
    meter.observe(9, now, writing=False)  # committed in between: straddles, left out
    assert meter.slowdown() == pytest.approx(0.5)
    faster = SlowdownMeter(min_samples=1)
    faster.observe(1, 0.0, False), faster.observe(2, 2.0, False)
    faster.staged(2, 2.0), faster.observe(3, 3.0, True)
    assert faster.slowdown() == 0.0  # never below zero


def test_a_save_costs_its_stall_plus_the_slowdown_of_the_steps_it_overlaps(tmp_path):
    clock, ops, handles = FakeClock(), GatedOps(open_gate=True), []
    policy = OptimalInterval(mtbf_s=3600)
    with CheckpointEngine(tmp_path, save_policy=EveryNSteps(10), clock=clock, file_ops=ops) as engine:
        for step in range(1, 31):
            if step % 10 == 1:
                ops.gate.clear()  # saves at 10, 20 stay in flight for the next steps
            if step % 10 == 5:
                ops.gate.set()
                engine.wait()
            clock.now += 1.5 if step % 10 in (1, 2, 3, 4) and step > 10 else 1.0
            handle = engine.maybe_save(lambda: state_for(step), step=step)
            if handle is not None:
                handles.append(handle)
        engine.wait()
        context = engine.decision_context(31)
        summary = engine.summary()
    assert context.slowdown == pytest.approx(0.5) == summary["write_slowdown"]
    assert summary["save_p50_s"] == sorted(h.stats.stall_s + h.stats.commit_s for h in handles)[1]
    done = [handle.stats for handle in handles]
    assert [s.step for s in done] == [10, 20, 30]
    stall = sum(s.stall_s for s in done) / 3
    write = sum(s.commit_s for s in done) / 3
    assert context.cost_s == pytest.approx(stall + 0.5 * write)
    assert policy.interval_s(context) == pytest.approx(max((2 * context.cost_s * 3600) ** 0.5, context.commit_s))


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_a_restarted_job_decides_from_what_saves_cost_the_process_before_it(tmp_path):
    """Preemptible jobs restart often: OptimalInterval should not re-measure from nothing, nor save at once."""
    clock, ops = FakeClock(), GatedOps(open_gate=True)
    with CheckpointEngine(tmp_path, save_policy=EveryNSteps(10), clock=clock, file_ops=ops) as engine:
        for step in range(1, 31):  # the same job as above: writes slow the steps they overlap by half
            if step % 10 == 1:
                ops.gate.clear()
            if step % 10 == 5:
                ops.gate.set()
                engine.wait()
            clock.now += 1.5 if step % 10 in (1, 2, 3, 4) and step > 10 else 1.0
            engine.maybe_save(lambda: state_for(step), step=step)
        engine.wait()
        before = engine.decision_context(31)
    assert before.slowdown == pytest.approx(0.5)

    policy = OptimalInterval(mtbf_s=3600)
    with CheckpointEngine(tmp_path, save_policy=policy, clock=clock) as engine:  # the next process
        assert engine.load()["step"] == 30
        context = engine.decision_context(31)
        assert context.slowdown == pytest.approx(0.5) and context.idle_needed == 0
        assert context.cost_s == pytest.approx(before.cost_s) and context.commit_s == pytest.approx(before.commit_s)
        interval = policy.interval_s(context)
        assert interval > 1
        loaded_at = clock.now
        clock.now = loaded_at + 0.9 * interval  # the checkpoint just loaded is as recent as a save
        assert engine.maybe_save(lambda: state_for(31), step=31) is None
        clock.now = loaded_at + 1.1 * interval
        assert engine.maybe_save(lambda: state_for(32), step=32) is not None

    (tmp_path / HISTORY_NAME).unlink()  # without the record: measured from nothing, saved at the first point
    with CheckpointEngine(tmp_path, save_policy=policy, clock=clock) as engine:
        engine.load()
        assert engine.decision_context(33).cost_s is None
        assert engine.maybe_save(lambda: state_for(33), step=33) is not None


def test_should_save_asks_an_adapters_own_policy_when_given_one(tmp_path):
    with CheckpointEngine(tmp_path) as engine:  # no save_policy of its own
        with pytest.raises(ConfigError, match="save_policy"):
            engine.should_save(4)
        assert engine.should_save(4, policy=EveryNSteps(2))
        assert not engine.should_save(5, policy=EveryNSteps(2))
        engine.save(state_for(6), step=6)
        assert not engine.should_save(6, policy=EveryNSteps(2))  # saved already
