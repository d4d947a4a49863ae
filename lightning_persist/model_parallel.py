"""``PersistModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` saving and loading through the engine.

``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallel) never calls a ``CheckpointIO``: it
writes ``torch.distributed.checkpoint`` directories itself. This subclass changes what it must for
sharded checkpoints to go through :class:`~lightning_persist.PersistCheckpointIO` instead:

* the state dicts are built sharded and on the device (``cpu_offload=False``): the staging copy
  into host memory is the only copy, and ``save`` returns once it is staged;
* every rank calls the plugin's ``save_checkpoint`` (its own gloo group commits), so each writes
  the parts it holds and the paths of ``ModelCheckpoint`` (top-k, ``last.ckpt``) link as always;
* ``load_checkpoint`` fills the model's and optimizers' sharded state in place, each rank reading
  only the byte ranges its parts need — from any number of devices the checkpoint was saved on;
* ``teardown`` calls the plugin's ``teardown`` on every rank (``ModelParallelStrategy``'s does not), so
  ``fit`` returns with every save committed and linked.

Without a ``PersistCheckpointIO`` it is the plain strategy.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_persist.checkpoint_io import PersistCheckpointIO
from persist_core import TorchCollectives

_SHARDED = ("state_dict", "optimizer_states")


class PersistModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints are the plugin's: asynchronous, sharded, verified, synced.

    Example::

        io = PersistCheckpointIO(local_dir="/nvme/ckpt", remote_url="s3://bucket/run-7", keep_last=3)
        trainer = Trainer(strategy=PersistModelParallelStrategy(data_parallel_size=8), devices=8, plugins=[io])
        trainer.fit(model, ckpt_path=io.latest_path())   # any number of devices, any data/tensor parallel split

    Args:
        commit_timeout_s: how long a rank waits for the others to finish writing one checkpoint
            before that save fails (default 1800 s).
        **kwargs: passed to ``ModelParallelStrategy`` (``save_distributed_checkpoint`` must stay True:
            the checkpoint is sharded, and ``persist export`` makes it whole when wanted).
    """

    def __init__(self, *, commit_timeout_s: float = 1800.0, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            from persist_core import ConfigError

            raise ConfigError("PersistModelParallelStrategy(save_distributed_checkpoint=False): its checkpoints are "
                              "sharded by design; drop the argument (`persist export --format torch` writes a whole one)")
        super().__init__(**kwargs)
        self._commit_timeout_s = commit_timeout_s

    @property
    def _persist_io(self) -> PersistCheckpointIO | None:
        io = self.checkpoint_io
        return io if isinstance(io, PersistCheckpointIO) else None

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        if self._persist_io is not None:
            self._persist_io._use_collectives(TorchCollectives.new_group(timeout_s=self._commit_timeout_s))

    def teardown(self) -> None:
        """Wait for the plugin's saves, then tear down as ``ModelParallelStrategy`` does.

        ``ModelParallelStrategy.teardown`` never calls ``checkpoint_io.teardown()`` (``Strategy.teardown``
        does), so ``fit`` returned with the last save still being written and its paths (``last.ckpt``)
        naming the one before, until the interpreter exited. Every rank calls it here, while the commit's
        process group still lives: each waits until every save is committed, linked and uploaded.
        """
        io = self._persist_io
        try:
            if io is not None:
                io.teardown()
        finally:
            super().teardown()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._persist_io is None:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._persist_io is None:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer),
                                        options=StateDictOptions(cpu_offload=False))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        io = self._persist_io
        if io is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        io.save_checkpoint(checkpoint, self.broadcast(filepath), storage_options=storage_options)  # every rank

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        io = self._persist_io
        if io is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            _init_optim_state,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        for opt in optimizers:
            _init_optim_state(opt)  # Adam's moments exist before its first step only like this: they are targets
        into = {"state_dict": get_model_state_dict(self.model),
                "optimizer_states": [get_optimizer_state_dict(self.model, opt) for opt in optimizers]}
        checkpoint = io.load_checkpoint(self.broadcast(checkpoint_path), into=into)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, checkpoint["state_dict"], options=StateDictOptions(strict=strict))
        for opt, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(self.model, opt, optim_state_dict=state)
        for key in _SHARDED:  # in place already; the rest (loops, callbacks, hyper-parameters) goes to Lightning
            checkpoint.pop(key, None)
        return checkpoint
