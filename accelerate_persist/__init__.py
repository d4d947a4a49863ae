"""torch-persist for Hugging Face Accelerate: one hook registered with an ``Accelerator``.

``PersistHook(local_dir=..., remote_url=...).register(accelerator)``; see :class:`PersistHook`.
"""

from typing import Any

from accelerate_persist.hook import PersistHook

__all__ = ["PersistHook", "PersistTrainerCallback", "export_accelerate"]


def __getattr__(name: str) -> Any:
    """Imported on first use: ``export_accelerate`` (so ``python -m accelerate_persist.export`` runs the
    module once) and ``PersistTrainerCallback`` (it imports ``transformers``)."""
    if name == "export_accelerate":
        from accelerate_persist.export import export_accelerate

        return export_accelerate
    if name == "PersistTrainerCallback":
        from accelerate_persist.trainer import PersistTrainerCallback

        return PersistTrainerCallback
    raise AttributeError(f"module 'accelerate_persist' has no attribute {name!r}")
