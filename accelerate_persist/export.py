"""Export a torch-persist checkpoint saved by :class:`PersistHook` as a plain Accelerate checkpoint.

The output directory holds the files ``accelerator.save_state(dir)`` writes (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``, ``dl_state_dict.bin``, ``scaler.pt``,
``random_states_<i>.pkl``, ``custom_checkpoint_<i>.pkl``), so ``accelerator.load_state(dir)``
— without torch-persist — restores it.

Usage: ``python -m accelerate_persist.export SOURCE OUT_DIR [--step N] [--storage-options JSON]``
where SOURCE is a ``local_dir`` or a remote URL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from persist_core import CheckpointReader, ConfigError
from persist_core.layout import is_url


def export_accelerate(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, step: int | None = None,
                      storage_options: dict[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                      weights_only: bool = True, remote_encryption_key: Any = None) -> Path:
    """Write checkpoint ``step`` (default: the newest) of ``source`` as an Accelerate checkpoint directory.

    Args:
        source: the hook's ``local_dir``, or its ``remote_url`` (downloaded into ``cache_dir``).
        out_dir: the directory to write (created; must not hold an Accelerate checkpoint already).
        step: which checkpoint; the newest committed one by default.
        storage_options: fsspec options for a remote ``source``.
        cache_dir: where a remote checkpoint is downloaded and kept (default: a temporary directory,
            removed when the export ends).
        weights_only: unpickle non-tensor leaves with the allowlist (default); ``False``: full pickle,
            for checkpoints you trust.
        remote_encryption_key: the key the remote was written with (32 bytes, or a callable returning them), if
            it is encrypted.

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: ``out_dir`` holds files already, or the checkpoint was not saved by PersistHook.
        EncryptionKeyError: the remote is encrypted and no key, or another key, was given.
        CheckpointNotFoundError / CorruptCheckpointError: as for loading.
    """
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"out_dir={str(out)!r} is not empty; export into a new directory")
    text = os.fspath(source)
    remote = is_url(text)
    _check_saved_by_hook(text, remote, step, storage_options, remote_encryption_key)  # before downloading anything
    with contextlib.ExitStack() as stack:
        if remote and cache_dir is None:
            local = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="persist-export-")))
        else:
            local = Path(cache_dir) if remote else Path(text.removeprefix("file://"))
        with CheckpointReader(local, remote_url=text if remote else None,
                              storage_options=storage_options if remote else None,
                              remote_encryption_key=remote_encryption_key if remote else None) as reader:
            state = reader.load(step, weights_only=weights_only)
    if not (isinstance(state, dict) and _HOOK_KEYS <= state.keys()):
        raise ConfigError(f"the checkpoint in {text} was not saved by accelerate_persist.PersistHook; nothing to export")
    out.mkdir(parents=True, exist_ok=True)
    for i, weights in enumerate(state["models"]):
        # safetensors refuses shared storage; Accelerate's own save drops duplicates the same way
        unique: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int]] = set()
        for name, tensor in weights.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
            unique[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
            seen.add(key)
        save_file(unique, out / ("model.safetensors" if i == 0 else f"model_{i}.safetensors"), metadata={"format": "pt"})
    for name, items in (("optimizer", state["optimizers"]), ("scheduler", state["schedulers"])):
        for i, item in enumerate(items):
            torch.save(item, out / (f"{name}.bin" if i == 0 else f"{name}_{i}.bin"))
    for i, dl in enumerate(state["dataloaders"]):
        if dl["sampler"] is not None:
            torch.save(dl["sampler"], out / ("sampler.bin" if i == 0 else f"sampler_{i}.bin"))
        if dl["state_dict"] is not None:
            torch.save(dl["state_dict"], out / ("dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"))
    if state["scaler"] is not None:
        torch.save(state["scaler"], out / "scaler.pt")
    for i, proc in enumerate(state["per_process"]):
        rng = proc["rng"]
        states = {"step": proc["step"], "random_state": rng["python"], "numpy_random_seed": rng["numpy"],
                  "torch_manual_seed": rng["torch"]}
        if "cuda" in rng:
            states["torch_cuda_manual_seed"] = rng["cuda"]
        torch.save(states, out / f"random_states_{i}.pkl")
    for i, custom in enumerate(state["custom"]):
        torch.save(custom, out / f"custom_checkpoint_{i}.pkl")
    umask = os.umask(0)
    os.umask(umask)
    for written in out.iterdir():  # safetensors writes 0600; the files get the modes any new file gets here
        written.chmod(0o666 & ~umask)
    return out


_HOOK_KEYS = {"models", "optimizers", "per_process"}


def _check_saved_by_hook(text: str, remote: bool, step: int | None, storage_options: dict[str, Any] | None,
                         key: Any = None) -> None:
    """Read only the manifest of the checkpoint to export and refuse one PersistHook did not save.

    Raises:
        ConfigError: it holds another kind of state (a Lightning or engine checkpoint).
        CheckpointNotFoundError: nothing committed (for ``step``).
    """
    from persist_core import CheckpointNotFoundError
    from persist_core.tiers.codec import Codec, SecretKey
    from persist_core.tiers.local import LocalTier
    from persist_core.tiers.remote import RemoteTier

    codec = Codec(None, SecretKey(key)) if key is not None else None
    tier: Any = RemoteTier(text, storage_options, codec=codec) if remote else LocalTier(Path(text.removeprefix("file://")))
    try:
        steps = tier.committed_steps()
        if step is None and not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {text}")
        chosen = steps[-1] if step is None else step
        if chosen not in steps:
            raise CheckpointNotFoundError(f"no committed checkpoint for step {chosen} in {text}; steps: {steps}")
        tree = tier.read_manifest(chosen).tree
    finally:
        if remote:
            tier.close()
    keys = {k.get("value") for k, _ in tree.get("dict", [])} if isinstance(tree, dict) else set()
    if not _HOOK_KEYS <= keys:
        raise ConfigError(f"the checkpoint of step {chosen} in {text} was not saved by accelerate_persist.PersistHook "
                          f"(its state holds {sorted(str(k) for k in keys)[:6]}); nothing to export, nothing downloaded")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelerate_persist.export", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the hook's local_dir or remote_url")
    parser.add_argument("out_dir", help="the Accelerate checkpoint directory to write")
    parser.add_argument("--step", type=int, help="which checkpoint (default: the newest)")
    parser.add_argument("--storage-options", type=json.loads, help="fsspec options as JSON")
    args = parser.parse_args(argv)
    try:
        out = export_accelerate(args.source, args.out_dir, step=args.step, storage_options=args.storage_options)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}; load it with accelerator.load_state({str(out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
