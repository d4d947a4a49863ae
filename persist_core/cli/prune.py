"""Removing checkpoints: ``persist gc`` (by retention policy) and ``rm`` (by step), never the last good one."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import click

from persist_core.errors import CheckpointNotFoundError, PersistError
from persist_core.tiers.codec import EncryptionKeyError
from persist_core.ownership import describe
from persist_core.sync.record import read_unsynced
from persist_core.policies.anyof import policy_from_keywords
from persist_core.policies.retention import Retainer, RetentionDecision, RetentionReason
from persist_core.cli.memory import remove_stale_memory
from persist_core.cli.app import CommandError, Location, human_size, main, open_location


def _newest_verified(loc: Location, steps: list[int], say: Callable[[str], Any] = click.echo) -> int | None:
    """The newest of ``steps`` whose files verify (every byte against its checksums); says which do not."""
    for step in sorted(steps, reverse=True):
        try:
            problems = loc.tier.verify(step)
        except EncryptionKeyError:  # not a bad checkpoint: the key is missing or another
            raise
        except PersistError as e:
            problems = [str(e)]
        if not problems:
            return step
        say(f"step {step} does not verify: {problems[0]}")
    return None


def _not_counted(loc: Location, counted: set[int]) -> dict[int, str]:
    """Committed checkpoints (a manifest) that :meth:`Location.list` left out, with why: an unreadable manifest,
    or a file missing or of the wrong size (the cheap check: one listing, on S3 too)."""
    why: dict[int, str] = {}
    for step in loc.tier.committed_steps():
        if step in counted:
            continue
        try:
            loc.tier.read_manifest(step)
        except CheckpointNotFoundError:  # removed since it was listed
            continue
        except EncryptionKeyError:
            raise
        except PersistError as e:
            why[step] = str(e)
    return why


def _depends_on(loc: Location, step: int) -> set[int]:
    """The checkpoints ``step`` references (incremental saves); none for one whose manifest does not read (it is not
    a checkpoint that loads: it protects nothing)."""
    try:
        return set(loc.tier.read_manifest(step).depends_on())
    except EncryptionKeyError:  # unknown without the key: nothing may be removed as if it protected nothing
        raise
    except PersistError:
        return set()


def _referenced_by(loc: Location, staying: list[int]) -> dict[int, list[int]]:
    """Each checkpoint that one of ``staying`` references (incremental saves), with the ones that do."""
    out: dict[int, list[int]] = {}
    for step in staying:
        for dep in _depends_on(loc, step):
            out.setdefault(dep, []).append(step)
    return out


def _why_kept(decision: RetentionDecision, remote: str | None, record_read: bool) -> tuple[str, str] | None:
    """What ``gc`` says of a checkpoint the plan keeps, and what it adds in text; ``None``: nothing to say (the
    policy keeps it, or it is the newest)."""
    reason = decision.reason
    if reason is RetentionReason.UNSYNCED:
        why = f"not yet uploaded to {remote}" if record_read else "the record of what is uploaded is unreadable"
        return why, " (the job uploads it when the remote is back; `persist push` does too)"
    if reason is RetentionReason.NEWEST_VERIFIED and not decision.policy_keeps:
        return "the newest checkpoint that verifies", " (the policy would remove it)"
    if reason is RetentionReason.REFERENCED:
        return f"referenced by step(s) {list(decision.referenced_by)} (incremental checkpoints)", ""
    return None


def _remove_abandoned(loc: Location, *, dry_run: bool, say: Callable[[str], Any]) -> list[dict[str, Any]]:
    """Remove (``dry_run``: only name) every set-aside checkpoint of ``loc``; returns them as ``{step, path, bytes}``.

    Only what :meth:`abandoned` lists goes, by its own set-aside name: never a live checkpoint. Nor one a live
    checkpoint references: a live checkpoint's references name live, older checkpoints by step (resolved under their
    live names), a branch sets aside only steps newer than the one it resumed from, and every save after it
    references the live branch. What a set-aside checkpoint references is live (kept from retention while it is:
    :meth:`LocalTier.abandoned_referenced`), and no longer held once it goes.
    """
    found = loc.tier.abandoned()
    for info in sorted(found, key=lambda c: -c.step):  # the newest first: references point back only
        if not dry_run:
            loc.tier.remove_abandoned(info.path)
        say(f"{'would remove' if dry_run else 'removed'} abandoned step {info.step} ({human_size(info.nbytes)}): "
            f"{info.path}")
    if not found:
        say(f"no abandoned checkpoints in {loc.name}")
    return [{"step": c.step, "path": c.path, "bytes": c.nbytes} for c in found]


@main.command()
@click.argument("location")
@click.option("--keep-last", type=int, default=None)
@click.option("--keep-every-n-steps", type=int, default=None)
@click.option("--keep-every-n-seconds", type=float, default=None)
@click.option("--incomplete-older-than", type=float, default=3600.0, show_default=True,
              help="remove directories/prefixes without a manifest only when older than this (seconds): "
                   "a running job may be writing them")
@click.option("--dry-run", is_flag=True, help="only say what would be removed")
@click.option("--verify", "verify_all", is_flag=True,
              help="read every checkpoint, every byte against its checksums, and count only those that verify")
@click.option("--no-verify", is_flag=True,
              help="do not read checkpoints to find the newest that verifies (then only the newest committed one "
                   "is kept whatever the policy)")
@click.option("--json", "as_json", is_flag=True, help="one JSON report: removed, kept (and why), incomplete")
@click.option("--memory", "memory", is_flag=True,
              help="also remove the run's memory snapshots that no live process holds (a stopped run's, in /dev/shm)")
@click.option("--memory-dir", default=None, help="where the memory snapshots are (default /dev/shm/torch-persist-<uid>)")
@click.option("--abandoned", is_flag=True,
              help="also remove the branches set aside by a resume from an older step (`persist ls` lists them as "
                   "abandoned); never a live checkpoint")
@click.pass_context
def gc(ctx: click.Context, location: str, keep_last: int | None, keep_every_n_steps: int | None,
       keep_every_n_seconds: float | None, incomplete_older_than: float, dry_run: bool, verify_all: bool,
       no_verify: bool, as_json: bool, memory: bool, memory_dir: str | None, abandoned: bool) -> None:
    """Prune with the engine's retention policies (e.g. `persist gc /nvme/ckpt --keep-last 3`).

    The policy counts only checkpoints whose manifest reads and whose files have their sizes (with
    --verify: only those whose every byte checks); the others are neither counted nor removed (said,
    with why: `persist rm --step N` removes one).

    Never removed: the newest committed checkpoint; the newest checkpoint that verifies (gc reads the
    newest ones, every byte against its checksums, until one verifies, so corrupt newer ones never
    cost the last good one); a live job's un-synced checkpoints and temporaries.

    With --abandoned (alone, or with a policy) the set-aside branches go too: the checkpoints a resume from an
    older step moved aside (`persist gc /nvme/ckpt --abandoned`, then the remote's URL).
    """
    if verify_all and no_verify:
        raise click.UsageError("--verify (read every checkpoint) and --no-verify (read none) contradict: pass one")
    if not incomplete_older_than >= 0:  # nan too: it compares as nothing, so it would remove nothing, silently
        raise click.UsageError(f"--incomplete-older-than={incomplete_older_than:g} must be >= 0 (seconds; inf: "
                               "never): a running job may be writing a directory without a manifest right now")
    policy = policy_from_keywords(keep_last, keep_every_n_steps, keep_every_n_seconds)
    say = (lambda text: None) if as_json else click.echo
    removed: list[str] = []
    if memory:
        removed = remove_stale_memory(location, memory_dir, dry_run=dry_run)
        for path in removed:
            say(f"{'would remove' if dry_run else 'removed'} memory snapshots of a stopped process: {path}")
        if not removed and policy is None:
            say("no memory snapshots of a stopped process")
    aside = _remove_abandoned(open_location(ctx, location), dry_run=dry_run, say=say) if abandoned else []
    if policy is None and (memory or abandoned):
        if as_json:
            click.echo(json.dumps({"location": location, "dry_run": dry_run, "removed": [], "memory_removed": removed,
                                   **({"abandoned_removed": aside} if abandoned else {})}))
        return
    if policy is None:
        raise click.UsageError("say what to keep: --keep-last, --keep-every-n-steps and/or --keep-every-n-seconds "
                               "(or --memory alone: a stopped run's memory snapshots; --abandoned alone: the "
                               "set-aside branches)")
    loc = open_location(ctx, location)
    report: dict[str, Any] = {"location": location, "dry_run": dry_run, "removed": [], "kept": [], "incomplete": [],
                              "memory_removed": removed, **({"abandoned_removed": aside} if abandoned else {})}
    listed = loc.list()  # reads every manifest: once; leaves out what does not check
    not_counted = _not_counted(loc, {c.step for c in listed})
    if verify_all:
        for info in listed:
            try:
                problems = loc.tier.verify(info.step)
            except PersistError as e:
                problems = [str(e)]
            if problems:
                not_counted[info.step] = problems[0]
        listed = [c for c in listed if c.step not in not_counted]
    counted = [c.step for c in listed]
    held: dict[int, RetentionReason] = {}
    remote, unsynced = read_unsynced(loc.root) if loc.root is not None else (None, set())
    # a live job's un-synced checkpoints (all, where its record does not read) are not gc's to take
    held.update(dict.fromkeys(counted if unsynced is None else sorted(unsynced & set(counted)),
                              RetentionReason.UNSYNCED))
    good = None if verify_all or no_verify else _newest_verified(loc, counted, say)  # --verify: every counted one does
    if good is not None and good != counted[-1]:  # (the newest is kept as the newest)
        held.setdefault(good, RetentionReason.NEWEST_VERIFIED)
    retainer = Retainer(loc.tier, policy, held=lambda: held, references=partial(_depends_on, loc))
    plan = retainer.plan(listed)
    verb = "would remove" if dry_run else "removed"

    def said(decision: RetentionDecision) -> None:
        say(f"{verb} step {decision.step} ({human_size(decision.info.nbytes)})")

    if dry_run:
        for decision in plan.removals:
            said(decision)
    else:
        retainer.carry_out(plan, said)
    report["removed"] = sorted(d.step for d in plan.removals)
    for decision in plan.decisions:
        kept = _why_kept(decision, remote, unsynced is not None)
        if kept is not None:
            say(f"kept step {decision.step}: {kept[0]}{kept[1]}")
            report["kept"].append({"step": decision.step, "why": kept[0]})  # the reason: in "plan"
    report["plan"] = plan.as_dicts()
    for step, why in sorted(not_counted.items()):
        say(f"not counted step {step}: {why} (left in place; `persist rm {location} --step {step}` removes it)")
    report["not_counted"] = [{"step": step, "why": why} for step, why in sorted(not_counted.items())]
    stale = []
    for path, age, owner in loc.incomplete():
        if owner is not None:
            say(f"kept incomplete {path}: owned by a live process ({describe(owner)})")
        elif age > incomplete_older_than:
            stale.append((path, age))
    for path, age in stale:
        if not dry_run:
            loc.remove_incomplete(path)
        say(f"{verb} incomplete {path} (no manifest, {age / 3600:.1f} h old)")
        report["incomplete"].append(path)
    if not plan.removals and not stale and not aside:
        say("nothing to remove")
    if as_json:
        click.echo(json.dumps(report))


@main.command()
@click.argument("location")
@click.option("--step", "steps", type=click.IntRange(min=0), multiple=True, required=True,
              help="the step to remove (repeatable)")
@click.option("--force", is_flag=True, help="also the newest committed checkpoint, or one not uploaded yet")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def rm(ctx: click.Context, location: str, steps: tuple[int, ...], force: bool, as_json: bool) -> None:
    """Remove committed checkpoints by step (a local one by one durable rename first, as retention does).

    The newest committed checkpoint, a local one not yet uploaded to its remote, and one that an incremental
    checkpoint staying references are refused unless --force: they may be the only good copy, or hold bytes
    another checkpoint needs.

    \b
    Example:
      persist rm /nvme/ckpt --step 1200 --step 1300
    """
    loc = open_location(ctx, location)
    committed = loc.tier.committed_steps()
    missing = [s for s in steps if s not in committed]
    if missing:
        raise CommandError(f"no committed checkpoint for step(s) {missing} in {location}; steps: {committed}")
    if not force:
        if committed and committed[-1] in steps:
            raise CommandError(f"step {committed[-1]} is the newest committed checkpoint in {location}; pass --force to "
                         "remove it anyway")
        if loc.root is not None:
            remote, unsynced = read_unsynced(loc.root)
            held = [s for s in steps if unsynced is None or s in unsynced]
            if held:
                raise CommandError(f"step(s) {held} are not uploaded to {remote or 'the remote'} yet (.unsynced.json); "
                             "pass --force to remove them anyway")
        refs = _referenced_by(loc, [s for s in committed if s not in steps])
        needed = {s: refs[s] for s in steps if s in refs}
        if needed:
            named = "; ".join(f"step {s} by step(s) {sorted(by)}" for s, by in sorted(needed.items()))
            raise CommandError(f"incremental checkpoints reference bytes of the checkpoints to remove ({named}): "
                               "removing them would make those unloadable; remove the dependents too (in the same "
                               "call), or pass --force")
    for s_ in sorted(steps, reverse=True):  # the newest first: a kill part-way leaves no dangling reference
        loc.tier.remove(s_)
        if not as_json:
            click.echo(f"removed step {s_} from {location}")
    if as_json:
        click.echo(json.dumps({"location": location, "removed": list(steps)}))
