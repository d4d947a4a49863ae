"""torch-persist for Hugging Face Accelerate: one hook registered with an ``Accelerator``.

``PersistHook(local_dir=..., remote_url=...).register(accelerator)``; see :class:`PersistHook`.
"""

from typing import Any

from accelerate_persist.hook import PersistHook

__all__ = ["PersistHook", "export_accelerate"]


def __getattr__(name: str) -> Any:
    """``export_accelerate`` on first use, so ``python -m accelerate_persist.export`` runs the module once."""
    if name == "export_accelerate":
        from accelerate_persist.export import export_accelerate

        return export_accelerate
    raise AttributeError(f"module 'accelerate_persist' has no attribute {name!r}")
