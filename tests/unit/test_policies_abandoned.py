"""Set-aside branches are kept, but never silently (issue 53, item 2): one warning, once per engine, when the
abandoned checkpoints hold more bytes on the local disk than the live branch, naming both sizes and the fix."""

from __future__ import annotations

import logging
from functools import partial

from persist_core import CheckpointEngine
from tests.support import states

state_for = partial(states.state_for, shape=(64, 64))

WARNING = "persist gc --abandoned"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and WARNING in r.getMessage()]


def test_one_warning_when_the_abandoned_branch_outgrows_the_live_one_naming_both_sizes(tmp_path, caplog):
    with CheckpointEngine(tmp_path) as engine:
        for step in (10, 20, 30, 40):
            engine.save(state_for(step), step=step)
    caplog.set_level(logging.WARNING)
    with CheckpointEngine(tmp_path) as engine:
        engine.load(10)
        engine.save(state_for(11), step=11)  # 20, 30, 40 set aside: 3 checkpoints against 2 live ones
        engine.wait()
        (said,) = _warnings(caplog)
        aside, live = sum(c.nbytes for c in engine.abandoned()), sum(c.nbytes for c in engine.list())
        assert aside > live and "3 abandoned checkpoints" in said and "2 live ones" in said
        assert f"{aside} bytes" in said and f"{live} bytes" in said and str(tmp_path) in said
        for step in (12, 13):
            engine.save(state_for(step), step=step)
        engine.wait()
        assert len(_warnings(caplog)) == 1  # once per engine


def test_no_warning_while_the_live_branch_holds_more(tmp_path, caplog):
    with CheckpointEngine(tmp_path) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
    caplog.set_level(logging.WARNING)
    with CheckpointEngine(tmp_path) as engine:
        engine.load(20)
        for step in (21, 22):
            engine.save(state_for(step), step=step)  # 30 set aside: 1 against 4 live
        engine.wait()
        assert [c.step for c in engine.abandoned()] == [30] and _warnings(caplog) == []
