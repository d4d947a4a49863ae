"""torch-persist for Hugging Face Accelerate: one hook registered with an ``Accelerator``.

``PersistHook(local_dir=..., remote_url=...).register(accelerator)``; see :class:`PersistHook`.
"""

from accelerate_persist.export import export_accelerate
from accelerate_persist.hook import PersistHook

__all__ = ["PersistHook", "export_accelerate"]
