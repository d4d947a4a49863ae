"""Preemption: the signal handler only records the signal; the flush runs on its own thread, then chains."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from persist_core import CheckpointEngine, CheckpointReader, ConfigError, PreemptionNotice
from persist_core.preemption import SignalFlush
from tests.support.fakes import GatedOps

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def _locks_of(engine: CheckpointEngine) -> list:
    """Every lock and condition the engine and its parts hold (one level into each part: the facade's own and those
    of ``engine._parts``, what the engine is made of, and the writer)."""
    found: dict[int, object] = {}

    def visit(obj: object) -> None:
        for value in vars(obj).values():
            if isinstance(value, _LOCK_TYPES):
                found.setdefault(id(value), value)
            elif isinstance(value, threading.Condition):
                found.setdefault(id(value), value)

    visit(engine)
    for part in [*vars(engine).values(), *vars(engine._parts).values(), engine._parts.pipeline.writer]:
        if hasattr(part, "__dict__") and type(part).__module__.startswith("persist_core"):
            visit(part)
    return list(found.values())


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_sigterm_while_the_training_thread_holds_every_engine_lock_flushes_then_chains(tmp_path):
    chained: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    ops = GatedOps()
    engine = CheckpointEngine(tmp_path, file_ops=ops)
    flush = SignalFlush(lambda: engine.wait, grace_s=60)
    try:
        assert flush.install()
        handle = engine.save({"w": torch.ones(1000), "step": 1}, step=1)
        assert ops.entered.wait(30)  # the write is running and cannot finish yet
        locks = _locks_of(engine)
        assert len(locks) >= 4, locks
        for lock in locks:
            lock.acquire()
        try:
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, on this thread, every lock held
        finally:
            for lock in reversed(locks):
                lock.release()
        assert not chained  # the previous handler waits for the flush
        ops.gate.set()
        assert flush.done.wait(60), "the flush never handed the signal on"
        assert chained == [signal.SIGTERM]
        assert handle.done() and [c.step for c in engine.list()] == [1]
    finally:
        ops.gate.set()
        flush.restore()
        signal.signal(signal.SIGTERM, previous)
        engine.close()


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_sigterm_with_the_default_action_flushes_then_ends_the_process_as_sigterm_does(tmp_path):
    child = textwrap.dedent(f"""
        import torch
        from persist_core import CheckpointEngine
        from persist_core.preemption import install_sigterm_flush
        engine = CheckpointEngine({str(tmp_path / "ckpt")!r})
        install_sigterm_flush(lambda: engine.wait, 60)
        engine.save({{"w": torch.arange(100_000.0), "step": 3}}, step=3)
        import os, signal, threading
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(60)  # training goes on while the flush runs; the flush then ends the process
        print("not ended", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr
    assert "not ended" not in done.stdout
    assert [c.step for c in CheckpointReader(tmp_path / "ckpt").list()] == [3]


def test_restore_puts_the_previous_handler_back_and_a_later_signal_reaches_it(tmp_path):
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        flush = SignalFlush(lambda: None, grace_s=5, signals=(signal.SIGUSR1,))
        assert flush.install()
        flush.restore()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_preemption_notice_refuses_a_signal_it_cannot_catch_and_leaves_handlers_as_they_were():
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ConfigError, match="SIGKILL.*cannot be caught"):
        PreemptionNotice(signals=(signal.SIGUSR1, signal.SIGKILL))
    assert signal.getsignal(signal.SIGUSR1) is before
