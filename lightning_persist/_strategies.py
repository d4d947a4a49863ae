"""Which Lightning strategies go around a ``CheckpointIO``, and saying so once.

A ``CheckpointIO`` gets no set-up hook, so the plugin calls :func:`check_strategy` at every call
that can see the Trainer (save, load, remove, teardown) until one did.
"""

from __future__ import annotations

from typing import Any

from persist_core import ConfigError

__all__ = ["StrategyBypassWarning", "check_strategy"]


class StrategyBypassWarning(UserWarning):
    """The Trainer's strategy writes its own checkpoints: this plugin is not used for them."""


_FIX = ("use strategy=PersistModelParallelStrategy(...) (FSDP2 / tensor parallel, sharded through the plugin), or "
        "strategy='ddp' / PersistDDPStrategy() for data parallel, with PersistCheckpointIO; or drop the plugin for "
        "this strategy")


def _bypass_of(strategy: Any) -> tuple[str, bool] | None:
    """``(what the strategy does, whether it breaks with this plugin)`` for a strategy that goes around
    CheckpointIO, or ``None`` for one that calls it for every save, load and removal."""
    name = type(strategy).__name__
    if name == "DeepSpeedStrategy":
        return "DeepSpeedStrategy writes and loads its own checkpoints and never calls a CheckpointIO", False
    if name == "ModelParallelStrategy":
        if getattr(strategy, "_save_distributed_checkpoint", True):
            return ("ModelParallelStrategy writes its own torch.distributed.checkpoint directories and never calls a "
                    "CheckpointIO to save or load them"), False
        return ("ModelParallelStrategy(save_distributed_checkpoint=False) saves through a CheckpointIO but loads "
                "checkpoints without it (unverified, never from remote_url)"), True
    if name == "FSDPStrategy":
        if getattr(strategy, "_state_dict_type", "full") == "sharded":
            return ("FSDPStrategy(state_dict_type='sharded') writes its own torch.distributed.checkpoint directories "
                    "and never calls a CheckpointIO to save or load them"), False
        return ("FSDPStrategy saves full state through a CheckpointIO but loads checkpoints without it "
                "(unverified, never from remote_url)"), True
    return None


def check_strategy(trainer: Any | None, already: bool, *, refuse: bool = True) -> bool:
    """Say once that the Trainer's strategy goes around this plugin; raise if it cannot work with it.

    A CheckpointIO gets no set-up hook, so this runs at the first call that can see the Trainer.
    Returns whether the Trainer was seen (no need to look again).

    Raises:
        ConfigError: a strategy that saves through this plugin but cannot load what it saved
            (with ``refuse``; else a warning says so).
    """
    if already or trainer is None:
        return already
    bypass = _bypass_of(getattr(trainer, "strategy", None))
    if bypass is None:
        return True
    what, breaks = bypass
    if breaks and refuse:
        raise ConfigError(f"{what}, so a run could not resume through PersistCheckpointIO; {_FIX}")
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(f"{what}: PersistCheckpointIO is not used for them (no local_dir, no remote_url, no retention, "
                   f"and its directories are removed as the default IO would). To checkpoint with torch-persist, "
                   f"{_FIX}", category=StrategyBypassWarning)
    return True
