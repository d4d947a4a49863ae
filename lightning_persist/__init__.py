"""torch-persist for PyTorch Lightning: one ``CheckpointIO`` plugin.

``Trainer(plugins=[PersistCheckpointIO(local_dir=..., remote_url=...)])``; see
:class:`PersistCheckpointIO`. With several processes, ``strategy=PersistDDPStrategy()`` makes
every rank write its part; ``strategy=PersistModelParallelStrategy(...)`` saves FSDP2 / tensor-parallel
state sharded through the plugin and resumes it on any number of devices.
"""

from lightning_persist.autosave import PersistAutoSave
from lightning_persist._strategies import StrategyBypassWarning
from lightning_persist.checkpoint_io import PersistCheckpointIO
from lightning_persist.loading import load_from_checkpoint
from lightning_persist.model_parallel import PersistModelParallelStrategy
from lightning_persist.strategy import PersistDDPStrategy

__all__ = ["PersistAutoSave", "PersistCheckpointIO", "PersistDDPStrategy", "PersistModelParallelStrategy",
           "StrategyBypassWarning", "load_from_checkpoint"]


def _register_with_pytorch_lightning() -> None:
    """Let ``pytorch_lightning.Trainer`` (the standalone package) accept the plugin too.

    Its ``CheckpointIO`` is ``lightning_fabric``'s, a different class with the same contract;
    registering as a virtual subclass passes its ``isinstance`` check without importing it here.
    """
    import importlib.util
    import sys

    if "lightning_fabric" not in sys.modules and importlib.util.find_spec("lightning_fabric") is None:
        return
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

    CheckpointIO.register(PersistCheckpointIO)


_register_with_pytorch_lightning()
