"""What ``save_state`` holds: every piece of an Accelerator's state, taken and put back.

:func:`capture` builds the state dict Accelerate itself would save (prepared models, optimizers,
schedulers, dataloader samplers / ``StatefulDataLoader`` states, the GradScaler, custom objects,
each process's RNG states and ``accelerator.step``); :func:`apply` restores it into the same set
of prepared objects. Every process calls both (``capture`` gathers the per-process values).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from persist_core import ConfigError

log = logging.getLogger(__name__)


def is_sharded(acc: Any) -> bool:
    """Whether ``acc`` trains FSDP2 (``fsdp_version=2``) models: their state is saved sharded (DTensors)."""
    return bool(getattr(acc, "is_fsdp2", False))


def sharded_states(models: list[torch.nn.Module], optimizers: list[Any], *,
                   targets: bool = False) -> tuple[list[Any], list[Any]]:
    """The sharded (DTensor) state dicts of FSDP2 ``models`` and their ``optimizers``, on the device
    (no CPU offload: the engine's staging copy is the only copy). With ``targets``, the optimizers'
    states are created first (Adam's moments exist only after a step), to be loaded into in place."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, _init_optim_state, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(cpu_offload=False)
    owners = [_owner(models, getattr(o, "optimizer", o)) for o in optimizers]
    if targets:
        for o in optimizers:
            _init_optim_state(getattr(o, "optimizer", o))
    return ([get_model_state_dict(m, options=options) for m in models],
            [get_optimizer_state_dict(m, getattr(o, "optimizer", o), options=options) for m, o in zip(owners, optimizers)])


def set_sharded_states(models: list[torch.nn.Module], optimizers: list[Any], model_states: list[Any],
                       optim_states: list[Any]) -> None:
    """Put sharded state dicts (filled in place by a load into :func:`sharded_states` targets) back."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for model, state in zip(models, model_states):
        set_model_state_dict(model, state)
    for optimizer, state in zip(optimizers, optim_states):
        inner = getattr(optimizer, "optimizer", optimizer)
        set_optimizer_state_dict(_owner(models, inner), inner, optim_state_dict=state)


def _owner(models: list[torch.nn.Module], optimizer: Any) -> torch.nn.Module:
    """The model whose parameters ``optimizer`` steps."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ConfigError("an optimizer steps parameters of none of the prepared models; prepare the model it belongs to")


def capture(acc: Any, *, optimizer_steps: int) -> dict[str, Any]:
    """The Accelerator's whole state (a collective call with several processes)."""
    if is_sharded(acc):
        models, optimizers = sharded_states(acc._models, acc._optimizers)
    else:
        models = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
        optimizers = [o.state_dict() for o in acc._optimizers]
    return {
        "models": models,
        "optimizers": optimizers,
        "schedulers": [s.state_dict() for s in acc._schedulers],
        "dataloaders": [_dataloader_state(dl) for dl in acc._dataloaders],
        "scaler": None if acc.scaler is None else acc.scaler.state_dict(),
        "custom": [obj.state_dict() for obj in acc._custom_objects],
        "per_process": _gather(acc, {"rng": _rng_state(), "step": acc.step}),
        "optimizer_steps": optimizer_steps,
        "iteration": acc.project_configuration.iteration,
    }


def apply(acc: Any, state: dict[str, Any]) -> int:
    """Restore ``state`` into ``acc``; returns the optimizer steps it was saved at.

    Raises:
        ConfigError: the checkpoint holds another number of models, optimizers, ... than ``acc``.
    """
    counts = {"models": len(acc._models), "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
              "custom": len(acc._custom_objects)}
    for key, n in counts.items():
        if len(state[key]) != n:
            raise ConfigError(
                f"the checkpoint holds {len(state[key])} {key} but this Accelerator has {n}; restore into the same "
                "set of prepared objects (and register_for_checkpointing calls) that saved it"
            )
    if is_sharded(acc):  # loaded into the targets in place (load_targets); put them back
        set_sharded_states(acc._models, acc._optimizers, state["models"], state["optimizers"])
    else:
        for model, weights in zip(acc._models, state["models"]):
            model.load_state_dict(_match_wrapping(weights, model))
        for optimizer, optim_state in zip(acc._optimizers, state["optimizers"]):
            optimizer.load_state_dict(optim_state)
    for scheduler, sched_state in zip(acc._schedulers, state["schedulers"]):
        scheduler.load_state_dict(sched_state)
    for dataloader, dl_state in zip(acc._dataloaders, state["dataloaders"]):
        _restore_dataloader(dataloader, dl_state)
    if acc.scaler is not None and state["scaler"] is not None:
        acc.scaler.load_state_dict(state["scaler"])
    for obj, obj_state in zip(acc._custom_objects, state["custom"]):
        obj.load_state_dict(obj_state)
    per_process = state["per_process"]
    mine = per_process[acc.process_index] if acc.process_index < len(per_process) else per_process[0]
    if acc.process_index >= len(per_process):
        log.warning("the checkpoint has RNG states for %d processes; process %d takes process 0's",
                    len(per_process), acc.process_index)
    _set_rng_state(mine["rng"])
    acc.step = mine["step"]
    acc.project_configuration.iteration = state["iteration"] + 1
    return state["optimizer_steps"]


def load_targets(acc: Any) -> dict[str, Any] | None:
    """What a load fills in place (``engine.load(into=...)``): the FSDP2 models' and optimizers' sharded
    state dicts on this process's mesh, so each process reads only its parts; ``None`` otherwise."""
    if not is_sharded(acc):
        return None
    models, optimizers = sharded_states(acc._models, acc._optimizers, targets=True)
    return {"models": models, "optimizers": optimizers}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather(accelerator: Any, value: Any) -> list[Any]:
    """Every process's ``value``, in process order (the same list on every process)."""
    if accelerator.num_processes == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(out, value)
    return out


def _dataloader_state(dataloader: Any) -> dict[str, Any]:
    """What Accelerate saves for a dataloader (a seedable sampler, a stateful loader's state), and what it
    does not: the loader's own generators (``shuffle=True, generator=g``) and its epoch count (what a
    seedable sampler seeds each epoch from), so a resumed run does not replay epoch 1's order."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    state: dict[str, Any] = {"sampler": None, "state_dict": None, "iteration": getattr(dataloader, "iteration", None),
                             "generators": [g.get_state() for g in _generators(dataloader)]}
    if isinstance(dataloader.dataset, IterableDatasetShard):
        sampler = dataloader.get_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            state["sampler"] = sampler
    if getattr(dataloader, "use_stateful_dataloader", False):
        state["state_dict"] = dataloader.state_dict()
    return state


def _restore_dataloader(dataloader: Any, state: dict[str, Any]) -> None:
    if state["sampler"] is not None:
        dataloader.set_sampler(state["sampler"])
    if state["state_dict"] is not None and getattr(dataloader, "use_stateful_dataloader", False):
        dataloader.load_state_dict(state["state_dict"])
    if state.get("iteration") is not None and hasattr(dataloader, "iteration"):  # checkpoints before it: none
        dataloader.iteration = state["iteration"]
    generators = _generators(dataloader)
    saved = state.get("generators") or []
    if saved and len(saved) != len(generators):
        log.warning("the checkpoint holds %d dataloader generators but this loader has %d; its order is not restored",
                    len(saved), len(generators))
        return
    for generator, generator_state in zip(generators, saved):
        generator.set_state(generator_state)


def _generators(dataloader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a (prepared) dataloader draws its order from, in a fixed order:
    its own, its sampler's and batch sampler's, through Accelerate's wrappers."""
    found: list[torch.Generator] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or depth > 4:
            return
        for name in ("generator", "sampler", "batch_sampler", "base_dataloader"):
            value = getattr(obj, name, None)
            if isinstance(value, torch.Generator):
                if id(value) not in seen:
                    seen.add(id(value))
                    found.append(value)
            elif value is not None and value is not obj and not isinstance(value, (int, str)):
                visit(value, depth + 1)

    visit(dataloader, 0)
    return found


def _match_wrapping(weights: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Saved by DDP (``module.`` keys) and loaded without it, or the other way round: rename."""
    have, want = set(weights), set(model.state_dict())
    if have == want:
        return weights
    if all(k.startswith("module.") for k in have) and {k[len("module."):] for k in have} == want:
        return type(weights)((k[len("module."):], v) for k, v in weights.items())
    if {f"module.{k}" for k in have} == want:
        return type(weights)((f"module.{k}", v) for k, v in weights.items())
    return weights  # load_state_dict names what does not match

