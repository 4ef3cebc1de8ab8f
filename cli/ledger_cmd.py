"""`ledger`: read a stored ledger: counts by state, one rollout, its history, an invariant
check, and an anchor of its history kept outside it.

Why these five: `counts` answers "where is my data", `show` and `history` answer "what
happened to this rollout and who did it", `check` replays the whole stored trace through
the same spec invariants the tests use, which is how a user verifies a ledger file after a
real run, and `anchor` writes the chain's head down in a file the operator keeps elsewhere,
so that `check --anchor` catches a history rewritten with every hash recomputed (which no
check of the store alone can). Every sub-command opens the backend read-only in spirit
(`create=False`): a mistyped path is an error, never a new empty database that reports "0
rollouts".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import click
from rich import box
from rich.console import Console
from rich.table import Table

from rollout_lifecycle.cli.exitcodes import InputError, TechnicalError, findings
from rollout_lifecycle.cli.output import (
    Progress,
    check_report_path,
    emit_report,
    quiet_option,
    report_options,
)
from rollout_lifecycle.cli.params import COUNT
from rollout_lifecycle.model.atomic import atomic_write, describe_os_error
from rollout_lifecycle.model.backends import DEFAULT_URL, Backend, open_backend, redact_url
from rollout_lifecycle.model.errors import (
    BackendUnavailable,
    InvalidLedgerArgument,
    OutputError,
    RolloutLifecycleError,
)
from rollout_lifecycle.model.events import EntryChanged
from rollout_lifecycle.model.machines import LIFECYCLE
from rollout_lifecycle.model.records import LedgerEntry, to_jsonable
from rollout_lifecycle.spec.audit import (
    Anchor,
    HistoryReport,
    audit,
    collector_paused,
    verify_history,
)
from rollout_lifecycle.spec.invariants import Violation, violated_names

__all__ = ["ledger"]

_COUNTERS = (
    "writes",
    "reservations",
    "idempotent_retries",
    "cas_conflicts",
    "refused",
    "commits",
    "aborts",
    "expirations",
)

backend_option = click.option(
    "--backend",
    "url",
    default=DEFAULT_URL,
    show_default=True,
    help=(
        "Ledger URL: sqlite:///relative.db, sqlite:////absolute.db or "
        "postgresql://user:password@host:5432/dbname (must exist)."
    ),
)


@contextlib.contextmanager
def _opened(url: str, *, create: bool = False) -> Iterator[Backend]:
    """Open an existing backend (or, with `create`, one to write deployment state into);
    project errors become one-line click errors."""
    try:
        backend = open_backend(url, create=create)
    except BackendUnavailable as exc:
        raise TechnicalError(f"--backend: {exc}") from None
    except RolloutLifecycleError as exc:
        raise click.UsageError(f"--backend: {exc}") from None
    try:
        yield backend
    except BackendUnavailable as exc:
        raise TechnicalError(str(exc)) from None
    except RolloutLifecycleError as exc:
        raise InputError(str(exc)) from None
    finally:
        backend.close()


def _when(at: float) -> str:
    """A timestamp as UTC ISO text; one no calendar can hold is shown as the raw number."""
    try:
        return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{at!r} (seconds since the epoch; out of calendar range)"


def _find(backend: Backend, rollout_id: str) -> LedgerEntry | None:
    """The entry, or None; an id no backend can store is a usage error, said as such."""
    try:
        return backend.ledger.find(rollout_id)
    except InvalidLedgerArgument as exc:
        raise click.BadParameter(str(exc), param_hint="ROLLOUT_ID") from None


@click.group("ledger")
def ledger() -> None:
    """Inspect a stored ledger: counts, one rollout, its history, an invariant check."""


@ledger.command("counts")
@backend_option
@report_options
@quiet_option
def counts(url: str, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Rollouts per lifecycle state (every state, zeros included) and the ledger's counters."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as backend:
        stats = backend.ledger.statistics()
        # outcomes some backends count per process (a lost CAS writes nothing): another
        # process's figure is not here, so they are named apart rather than shown as 0
        local = frozenset(getattr(backend.ledger, "process_local_counters", frozenset()))
    counters = {k: getattr(stats, k) for k in _COUNTERS if k not in local}
    not_stored = [k for k in _COUNTERS if k in local]
    data = {
        "schema": "rollout-lifecycle/ledger-counts/1",
        "backend": url,
        "entries": stats.entries,
        "by_state": stats.by_state,
        "counters": counters,
        "not_stored": not_stored,
        "bad_versions": list(stats.bad_versions),
        # staleness of what was trained, attempts per prompt, wasted generation, length bias
        "pacing": None if stats.pacing is None else to_jsonable(stats.pacing),
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=Console(stderr=True))
    if as_json:
        return
    table = Table(title=f"{stats.entries} rollouts in {url}")
    table.add_column("state")
    table.add_column("kind")
    table.add_column("count", justify="right")
    for state in LIFECYCLE.states:
        table.add_row(
            state, ", ".join(LIFECYCLE.display_tags(state)), str(stats.by_state.get(state, 0))
        )
    ctr = Table(title="counters")
    ctr.add_column("counter")
    ctr.add_column("value", justify="right")
    for k, v in counters.items():
        ctr.add_row(k, str(v))
    for k in not_stored:
        ctr.add_row(k, "not stored (each process counts its own)")
    console = Console()
    console.print(table)
    console.print(ctr)
    if stats.bad_versions:
        click.echo(f"versions marked bad: {', '.join(map(str, stats.bad_versions))}")
    pc = stats.pacing
    if pc is not None and pc.chains:
        lag = "-" if pc.trained_lag_mean is None else f"{pc.trained_lag_mean:.2f}"
        ks = "-" if pc.ks_length is None else f"{pc.ks_length:.3f}"
        click.echo(
            f"pacing: {pc.chains_trained}/{pc.chains} prompts trained, staleness mean {lag} "
            f"max {pc.trained_lag_max if pc.trained_lag_max is not None else '-'}, attempts max "
            f"{pc.max_attempts}, wasted {pc.wasted_fraction:.1%} of {pc.generated_tokens} "
            f"tokens, length bias (KS) {ks}"
        )


def _describe(entry: LedgerEntry) -> list[tuple[str, str]]:
    """The entry as (field, readable value) rows."""
    rows = [
        ("rollout_id", entry.rollout_id),
        ("state", entry.state),
        ("revision", str(entry.revision)),
        ("behavior_version", str(entry.behavior_version)),
        ("artifact_hash", entry.artifact_hash),
        ("reserved_by", entry.reserved_by or "-"),
        (
            "lease_expires_at",
            "-" if entry.lease_expires_at is None else _when(entry.lease_expires_at),
        ),
        ("releases", str(entry.releases)),
    ]
    r = entry.reward
    rows.append(
        ("reward", "-" if r is None else f"{r.value} ({r.function_id} {r.function_version})")
    )
    d = entry.disposition
    rows.append(
        (
            "failure",
            "-" if d is None else f"{d.stage}: {d.cause}" + (f" ({d.detail})" if d.detail else ""),
        )
    )
    a = entry.admission
    if a is None:
        rows.append(("admission", "-"))
    else:
        drift = "n/a" if a.drift is None else f"{a.drift:.4g}"
        rows.append(
            (
                "admission",
                f"{a.reason}: {a.freshness}, lag {a.lag} (max {a.max_lag}), drift {drift} "
                f"(max {a.max_drift}), judged at v{a.current_version}",
            )
        )
    return rows


@ledger.command("show")
@click.argument("rollout_id")
@backend_option
@report_options
@quiet_option
def show(rollout_id: str, url: str, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """One rollout's ledger entry: state, revision, owner, reward or failure, admission."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as backend:
        entry = _find(backend, rollout_id)
    if entry is None:
        raise InputError(f"rollout {rollout_id!r} is not in {url}")
    emit_report(
        to_jsonable(entry), as_json=as_json, report_path=report_path, console=Console(stderr=True)
    )
    if as_json:
        return
    table = Table(title=f"rollout {rollout_id}", show_header=False, box=box.SIMPLE)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    for k, v in _describe(entry):
        table.add_row(k, v)
    Console().print(table)


def _event_row(ev: EntryChanged) -> dict[str, Any]:
    return {
        "seq": ev.seq,
        "txn": ev.txn,
        "at": ev.at,
        "time": _when(ev.at),
        "event": ev.event,
        "before_state": None if ev.before is None else ev.before.state,
        "after_state": ev.after.state,
        "revision_before": None if ev.before is None else ev.before.revision,
        "revision_after": ev.after.revision,
        "update_id": ev.update_id,
    }


@ledger.command("history")
@click.argument("rollout_id")
@backend_option
@report_options
@quiet_option
def history(
    rollout_id: str, url: str, as_json: bool, report_path: Path | None, quiet: bool
) -> None:
    """Every write to one rollout, in order: event, before -> after state, revision, update."""
    del quiet  # one read, no progress to silence: accepted like on every command
    check_report_path(report_path)
    with _opened(url) as backend:
        known = _find(backend, rollout_id) is not None
        events = [e for e in backend.ledger.history(rollout_id) if isinstance(e, EntryChanged)]
        known = known or bool(events)
    if not known:
        raise InputError(f"rollout {rollout_id!r} is not in {url}")
    rows = [_event_row(e) for e in events]
    emit_report(rows, as_json=as_json, report_path=report_path, console=Console(stderr=True))
    if as_json:
        return
    days = {r["time"][:10] for r in rows}
    one_day = len(days) == 1
    title = f"history of {rollout_id} ({len(rows)} writes"
    title += f", UTC on {days.pop()})" if one_day else ", UTC)"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("seq", "time", "event", "before -> after", "rev", "update"):
        table.add_column(col, overflow="fold")
    for r in rows:
        before = r["before_state"] or "(new)"
        rev_before = "" if r["revision_before"] is None else f"{r['revision_before']}->"
        table.add_row(
            str(r["seq"]),
            r["time"][11:23] if one_day else r["time"][:23],
            r["event"],
            f"{before} -> {r['after_state']}",
            f"{rev_before}{r['revision_after']}",
            r["update_id"] or "-",
        )
    Console().print(table)


@ledger.command("check")
@backend_option
@click.option(
    "--quiescent",
    is_flag=True,
    help="The run is over: also require every reservation and activation to be resolved.",
)
@click.option(
    "--max-report",
    type=COUNT,
    default=50,
    show_default=True,
    help="Print at most this many violations (the count and the JSON report have them all).",
)
@click.option(
    "--anchor",
    "anchor_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="An anchor file written by `ledger anchor`: the chain must still pass through "
    "every head it holds (catches a history rewritten with every hash recomputed).",
)
@report_options
@quiet_option
def check(
    url: str,
    quiescent: bool,
    max_report: int,
    anchor_path: Path | None,
    as_json: bool,
    report_path: Path | None,
    quiet: bool,
) -> None:
    """Verify the stored history's hash chain, replay it through the spec, and compare
    every stored table with the replayed history.

    The chain names an edited, deleted, reordered, replaced or cut-off event by its seq, and
    the head it ends in (seq and hash) is printed (events stored before the chain existed
    are an unchained prefix, not a violation; a store that had a chain and lost its head or
    hashes is one). Every atomic step is judged by the step and always invariants (each bad
    record named once, when it goes bad). Every table in the audit's declared list must
    then match the history: deployment tables column by column, schema versions, the host
    clock's origin and bad-version marks against the rows their events record, the counters
    against the recorded writes; other tables are listed as not compared. With --anchor,
    the chain must pass through every anchored head. One snapshot, linear in the trace.
    Exit 1 on any violation, 2 on a missing or garbled anchor file.
    """
    check_report_path(report_path)
    anchors = read_anchors(anchor_path, must_hold=True) if anchor_path is not None else []
    tick = Progress("ledger check", quiet=quiet)
    started, cpu_started = time.perf_counter(), time.process_time()
    with _opened(url) as backend, collector_paused():  # flat cost per event: see there
        tick("reading every stored row and event")
        stored = backend.stored_rows()
    tick(f"verifying the hash chain and replaying {len(stored.events):,} events")
    result = audit(stored, quiescent=quiescent, anchors=anchors)
    report, store = result.trace, result.store
    violations = result.violations
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started  # this process's own CPU: what load cannot inflate
    tick(f"done in {elapsed:.1f}s", True)
    data = {
        "schema": "rollout-lifecycle/ledger-check/1",
        "backend": url,
        "events": report.events,
        "steps": report.steps,
        "rows": store.rows,
        "checked": result.checked,
        "history": {
            **result.history.summary(),
            "anchor_file": None if anchor_path is None else str(anchor_path),
        },
        "compared": list(store.compared),
        "not_compared": dict(store.not_compared),
        "ok": not violations,
        "violation_count": len(violations),
        "by_invariant": dict(violated_names(violations)),
        "violations": [attrs.asdict(v) for v in violations],
        "elapsed_s": round(elapsed, 3),
        "cpu_s": round(cpu, 3),
    }
    console = Console(quiet=as_json)
    if not as_json:
        for v in violations[:max_report]:
            click.echo(str(v))
        if len(violations) > max_report:
            click.echo(f"... and {len(violations) - max_report} more (see --json)")
        click.echo(_history_line(result.history))
        if store.not_compared:
            click.echo(
                "not compared: " + "; ".join(f"{k}: {why}" for k, why in store.not_compared.items())
            )
        click.echo(
            f"replayed {report.events} events in {report.steps} atomic steps against "
            f"{len(report.checked)} invariants, compared {store.rows} stored rows "
            f"({len(store.compared)} tables): {len(violations)} violations"
        )
    emit_report(data, as_json=as_json, report_path=report_path, console=console)
    if violations:
        raise findings()


def _history_line(h: HistoryReport) -> str:
    """One line on the hash chain: what it verified, its head, what predates it."""
    if not h.has_chain and h.required is None:
        return (
            f"history: no hash chain yet ({h.unchained_prefix} events written before it, by "
            "a program without the chain, and nothing says otherwise: no seal, schema "
            "versions or events of a chaining program; a writer of this version adds it on "
            "open): not verified"
        )
    if not h.has_chain:
        return f"history: the hash chain was removed although {h.required}"
    line = f"history: {h.chained} chained events checked against their hashes and the head"
    if h.head_hash is None:
        line += " (no head: see the findings)"
    else:
        line += f"\nhead: seq {h.head_seq}, hash {h.head_hash.hex()}"
    if h.unchained_prefix and h.head_hash is None:
        line += f"\n{h.unchained_prefix} events carry no hash (see the findings)"
    elif h.unchained_prefix:
        line += (
            f"\n{h.unchained_prefix} events before the chain began (an unchained prefix, "
            "not a violation)"
        )
    if h.anchors:
        line += f"\nanchors: {h.anchors} checked"
    return line


# ---- anchors: the chain's head, written down outside the store ---------------------------

ANCHOR_SCHEMA = "rollout-lifecycle/ledger-anchor/1"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def anchor_line(seq: int, head_hash: bytes, url: str) -> str:
    """One anchor: a JSON object on one line (seq, head hash, UTC time, the store)."""
    when = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    doc = {"seq": seq, "hash": head_hash.hex(), "time": when, "backend": redact_url(url)}
    return json.dumps(doc, separators=(",", ":")) + "\n"


def parse_anchors(text: str, where: str) -> list[Anchor]:
    """The anchors of an anchor file's text; InputError (exit 2) naming the first line that
    is not one (a garbled file must never pass as "no anchor was broken")."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        seq = doc.get("seq") if isinstance(doc, dict) else None
        digest = doc.get("hash") if isinstance(doc, dict) else None
        if (
            not isinstance(seq, int)
            or isinstance(seq, bool)
            or seq < 1
            or not isinstance(digest, str)
            or not _HEX64.fullmatch(digest)
        ):
            raise InputError(
                f"{where}: line {n} is not an anchor (a JSON object with an integer seq >= 1 "
                "and a 64-hex-digit hash, as `ledger anchor` writes): garbled or edited"
            )
        when = doc.get("time")
        out.append(Anchor(seq, bytes.fromhex(digest), when if isinstance(when, str) else "", n))
    return out


def read_anchors(path: Path, *, must_hold: bool) -> list[Anchor]:
    """The anchors in `path`; InputError (exit 2) when it cannot be read, is garbled, or
    (with `must_hold`) holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"--anchor: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = describe_os_error(exc) if isinstance(exc, OSError) else "not UTF-8 text"
        raise InputError(f"--anchor: cannot read {path} ({why})") from None
    anchors = parse_anchors(text, str(path))
    if must_hold and not anchors:
        raise InputError(f"--anchor: {path} holds no anchor (write one with `ledger anchor`)")
    return anchors


def append_anchor(path: Path, judge: Callable[[Sequence[Anchor]], str]) -> int:
    """Add one anchor line to `path` (created if missing), with the file locked.

    Under an exclusive lock of the file (flock) it is read, `judge(anchors)` returns the
    line to add (or raises, leaving the file as it was), and the file is written again
    WHOLE: a temporary file, fsync, rename, fsync of the folder (model.atomic), so a crash
    or a full disk leaves the old anchors or the new ones, never a torn last line that
    would make every later check a usage error. Appending with O_APPEND would be one
    write, but a torn line is exactly what it can leave. The lock serialises two anchorers
    (the second reads the first's line); one that locked a file since replaced retries
    on the new one. Returns how many anchors the file holds now."""
    if path.parent != Path() and not path.parent.is_dir():
        raise InputError(f"--to: folder {path.parent} does not exist; create it first")
    while True:
        created = False
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
                created = True
            except FileExistsError:
                fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            if exc.errno == errno.EISDIR:
                raise InputError(f"--to: {path} is a folder; give a file") from None
            raise InputError(f"--to: cannot open {path} ({describe_os_error(exc)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                continue  # replaced while this process waited: lock the new file
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"--to: {path} is not an anchor file (not UTF-8 text)") from None
            anchors = parse_anchors(text, str(path))
            try:
                line = judge(anchors)
            except BaseException:
                if created:  # leave no empty file behind for a refused first anchor
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise
            body = text if not text or text.endswith("\n") else text + "\n"
            try:
                atomic_write(path, body + line)
            except OutputError as exc:
                raise TechnicalError(str(exc)) from None
            return len(anchors) + 1
        finally:
            os.close(fd)


@ledger.command("anchor")
@backend_option
@click.option(
    "--to",
    "to_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The anchor file to add a line to (created if missing). Keep it where whoever can "
    "write the database cannot: another host, a write-once log, a ticket.",
)
@report_options
@quiet_option
def anchor(url: str, to_path: Path, as_json: bool, report_path: Path | None, quiet: bool) -> None:
    """Write the hash chain's head (seq, hash, time) down in a file kept outside the store.

    The chain is verified first (every hash and link, the head, and every anchor already in
    the file): a head is anchored only when the history through it checks out, so an
    anchor never vouches for an edit. `ledger check --anchor FILE` then verifies that the
    chain still passes through every anchored head: a history rewritten since, even with
    every hash recomputed, is caught. Exit 1 (nothing written) when the chain has a
    finding, 2 when the store has no chain to anchor or the file is garbled.
    """
    check_report_path(report_path)
    tick = Progress("ledger anchor", quiet=quiet)
    with _opened(url) as backend:
        tick("reading every stored event")
        stored = backend.stored_rows()
    bad: list[Violation] = []
    anchored: list[tuple[int, bytes]] = []

    def judge(anchors: Sequence[Anchor]) -> str:
        tick(f"verifying the hash chain of {len(stored.events):,} events")
        with collector_paused():
            report = verify_history(stored, anchors)
        if report.violations:
            bad.extend(report.violations)
            raise findings()
        head = stored.head
        if head is None or not report.has_chain or report.head_hash is None:
            raise InputError(f"{url} has no hash chain to anchor (no head)")
        if report.chained == 0:
            raise InputError(f"{url}: the chain holds no event yet; nothing to anchor")
        anchored.append((int(head.last_seq), report.head_hash))
        return anchor_line(int(head.last_seq), report.head_hash, url)

    try:
        count = append_anchor(to_path, judge)
    except click.exceptions.Exit:
        for v in bad:
            click.echo(str(v))
        click.echo(f"{len(bad)} findings in the chain: nothing anchored (see `ledger check`)")
        raise
    ((seq, digest),) = anchored
    tick("done", True)
    data = {
        "schema": ANCHOR_SCHEMA,
        "backend": url,
        "file": str(to_path),
        "seq": seq,
        "hash": digest.hex(),
        "anchors": count,
    }
    emit_report(data, as_json=as_json, report_path=report_path, console=Console(stderr=True))
    if not as_json:
        click.echo(f"anchored seq {seq}, hash {digest.hex()} in {to_path} ({count} anchors)")
