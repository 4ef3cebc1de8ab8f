"""The server-side functions every write of the PostgreSQL ledger and registry goes through.

With or without roles (model.postgres_roles), the client writes nothing itself: each
write of a step is ONE call of a SECURITY DEFINER function owned by the tables' owner, with
its `search_path` pinned to the deployment's schema (as PostgreSQL's documentation asks
of every SECURITY DEFINER function). Each function names the operation it runs for; it
refuses (SQLSTATE 42501, insufficient_privilege, its DETAIL naming the operation and the
roles it needs) an operation the caller's role may not run, and a change the operation
does not make:

    ledger_write_one_v7  a single compare-and-set with its event, counters and commit mark
                         (a reservation's update still recorded and not poisoned; the
                         chain's head checked against the newest event); with p_guard 3
                         a whole reservation in one call, only where it certainly wins
                         (`_ONE_CALL`), else 'moved' and nothing written
    rl_write_rows        a set of compare-and-sets (`CAS_MANY`), the winners returned
    rl_lock_rows         the rows a step reads to write (FOR UPDATE needs UPDATE rights)
    rl_insert_rows       new rollouts (add, dispatch)
    rl_append            a ledger step's events, counters and update records (ledger_updates)
    rl_bad_version       marking or clearing a bad version
    rl_registry_write    a registry step's rows and events, in one call
    rl_mark, rl_prune_marks   the commit mark of a step, and old marks pruned
    rl_check_chain       the event chain's check at open (it locks the head's row)

A row's stored state and its new one must be an edge of the operation's events ('>state'
for an insert); a reservation (a row going to 'reserved' from elsewhere) is refused
unless its rollout's version may be reserved now: ever active, not retired, and within the
recorded policy's max_lag of the pointer, judged under the premise lock the function
takes itself (`rl_reservable`, the same facts `model.rules.reservation_refusal` reads;
the stamp's own figures, the drift among them, stay the client's). The pointer moves only
with an activation every required worker acked with its current token, or a rollback to
the recorded rollback version; a worker's report is stored only for the worker id its
login is mapped to, and with a token only if it is that worker's stored one.

The functions are created (or replaced) when a ledger or registry opens a schema whose
copy is missing or differs from this program's: the text of every definition is hashed
into `schema_meta` (component 'functions'). With roles on, only the administrator who runs
`deployment roles` may (re)create them.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Sequence

from rollout_lifecycle.model.errors import LedgerError
from rollout_lifecycle.model.events import UpdateChange, row_event
from rollout_lifecycle.model.ledger import NESTED_IN_ENTRY
from rollout_lifecycle.model.postgres_common import (
    CHAIN_CHECK,
    CHAIN_PREV,
    COUNTER_SHARDS,
    K_EVENTS,
    K_PREMISE,
    K_REWARDED,
    K_SCHEMA,
    K_UPDATE,
    Conn,
    PostgresDatabase,
    append_events,
    append_statement,
    chain_message,
    quote_ident,
)
from rollout_lifecycle.model.postgres_roles import (
    CALLED_BY,
    REFUSAL_MARK,
    operation_rows,
)
from rollout_lifecycle.model.rules import ROLLBACK_KEPT, WAS_ACTIVE_STATES
from rollout_lifecycle.model.sql_unit import STORED_SHAPES

COMPONENT = "functions"

# what a step's one statement returns when the function raised nothing
# a changed body gets a new name: v1-v3 before roles; v4 (roles) the operation's checks;
# v5 (main, without roles) the chain's check and the update guard; v6 all of them
# v7 the one-call reservation (p_guard 3: judged and spliced by the server, see `_ONE_CALL`);
# since, p_guard 2 compares the premise of the versions its text names (issue 34): a text
# of the other form never matches, so a client and a schema one change apart answer
# 'moved' and reserve by a step, and the name stayed (the changed text reinstalls it)
WRITE_ONE = "ledger_write_one_v7"
# every name this program's functions ever had here: dropped before (re)creating them, so
# a changed signature or return type leaves no stale overload behind
OLD_NAMES = ("ledger_write_one_v4", "ledger_write_one_v5", "ledger_write_one_v6")

# The batch compare-and-set, the one statement inside `rl_write_rows`. `locked` takes the
# row locks of the rows whose revision still matches, in rollout_id order (deadlock-free
# against any other batch), re-checking the revision of rows that changed while it waited;
# the UPDATE then writes exactly those rows and returns their ids: the winners. `locked`
# finds the rows by the ids array through the primary key (a join with `v` alone was
# planned as a hash over the whole table), and the UPDATE joins `locked` itself. A row
# whose move is not an edge of the operation (`edges`), or a reservation of a version not
# reservable now (`versions`, NULL: no registry), is not locked either: the function then
# finds it (its revision still the expected one) and refuses the whole call.
CAS_MANY = """
WITH v AS (
    SELECT * FROM unnest(%(ids)b::text[], %(expected)b::bigint[], %(states)b::text[],
                         %(revisions)b::bigint[], %(owners)b::text[], %(leases)b::float8[],
                         %(entries)b::text[])
        AS v(rollout_id, expected, state, revision, reserved_by, lease, entry)
), locked AS (
    SELECT v.* FROM rollouts r JOIN v ON r.rollout_id = v.rollout_id
    WHERE r.rollout_id = ANY(%(ids)b::text[]) AND r.revision = v.expected
        AND (r.state || '>' || v.state) = ANY(%(edges)b::text[])
        AND (v.state <> 'reserved' OR r.state = 'reserved'
             OR COALESCE(r.behavior_version = ANY(%(versions)b::bigint[]),
                         %(versions)b::bigint[] IS NULL))
    ORDER BY r.rollout_id
    FOR UPDATE OF r
)
UPDATE rollouts r SET state = v.state, revision = v.revision, reserved_by = v.reserved_by,
    lease_expires_at = v.lease, entry = v.entry
FROM locked v
WHERE r.rollout_id = v.rollout_id AND r.revision = v.expected
RETURNING r.rollout_id
"""
# `CAS_MANY`'s placeholders inside the function: its parameters, and what it worked out
_CAS_VARS = {
    "ids": "p_ids",
    "expected": "p_expected",
    "states": "p_states",
    "revisions": "p_revisions",
    "owners": "p_owners",
    "leases": "p_leases",
    "entries": "p_entries",
    "edges": "v_edges",
    "versions": "v_versions",
}

# The single compare-and-set inside `ledger_write_one_v4`, over its parameters
# (benchmarks/postgres_floor.py times it alone in functions of its own)
CAS_STEP = """\
    UPDATE rollouts SET state = p_state, revision = p_revision, reserved_by = p_reserved_by,
        lease_expires_at = p_lease, entry = p_entry
    WHERE rollout_id = p_rollout_id AND revision = p_expected;
    IF NOT FOUND THEN
        RETURN 'lost';
    END IF;
"""
WRITE_ONE_ARGS = (
    ("p_op", "text"),
    ("p_guard", "integer"),
    ("p_premise", "text"),
    ("p_state", "text"),
    ("p_revision", "bigint"),
    ("p_reserved_by", "text"),
    ("p_lease", "double precision"),
    ("p_entry", "text"),
    ("p_rollout_id", "text"),
    ("p_expected", "bigint"),
    ("p_kind", "text"),
    ("p_payload", "text"),
    ("p_names", "text[]"),
    ("p_counts", "bigint[]"),
    ("p_update", "text"),
    ("p_token", "text"),
)
WRITE_ONE_CALL = f"SELECT {WRITE_ONE}({', '.join(['%s'] * len(WRITE_ONE_ARGS))})"

_WAS_ACTIVE = "ARRAY[" + ", ".join(f"'{s}'" for s in sorted(WAS_ACTIVE_STATES)) + "]"


def premise_sql(asked: str | None = None) -> str:
    """The premise's statement; `asked` (an SQL bigint[]) limits its sets to the versions a
    step judges (see `model.ledger.StoreView.read_premise`) and names them in the text, its
    fifth element, so a guarded write can read the same premise again (see `_write_one`)."""
    only = "" if asked is None else f" AND version = ANY({asked})"
    named = "" if asked is None else f", to_json({asked})"
    return (
        "json_build_array((SELECT version FROM registry_pointer WHERE id = 1), "
        "(SELECT json_agg(json_build_array(version, artifact_hash) ORDER BY version) "
        f"FROM registry_artifacts WHERE state = ANY({_WAS_ACTIVE}){only}), "
        # by name (to_jsonb): a registry not yet migrated to the newer columns reads defaults
        "(SELECT json_build_array(max_lag, max_drift, batch_size, max_attempts, "
        "to_jsonb(p) ->> 'lineage', to_jsonb(p) ->> 'chain_key') "
        "FROM registry_policy p WHERE id = 1), "
        "(SELECT json_agg(json_build_array(version, failure) ORDER BY version) "
        f"FROM registry_artifacts WHERE state = 'rolled_back'{only}){named})::text"
    )


# The reservation's premise as ONE deterministic JSON text (sets in order): of every
# version (PREMISE), or of the versions asked, read by primary key so that it costs the
# same however many versions the run published: inside a step (PREMISE_OF, one bigint[]
# parameter given three times), with a row outside any step (the ledger's peek: its row's
# version and its stamp's), and again under the premise lock by a single reservation's
# write, compared with the text its plan was judged on (an equality of facts, not a rule).
PREMISE = premise_sql()
PREMISE_OF = premise_sql("%s::bigint[]")

# every function a caller may EXECUTE, with its signature (the others are internal)
SIGNATURES = {
    WRITE_ONE: ", ".join(t for _, t in WRITE_ONE_ARGS),
    "rl_write_rows": "text, text[], bigint[], text[], bigint[], text[], double precision[], text[]",
    "rl_lock_rows": "text, text, text, double precision, text[]",
    "rl_insert_rows": "text, json",
    "rl_append": "text, text[], text[], text[], json, json",
    "rl_bad_version": "text, bigint, text, boolean",
    "rl_registry_write": "text, json, text[], text[], text[]",
    "rl_mark": "text",
    "rl_prune_marks": "",
    CHAIN_CHECK: "",
}
assert set(SIGNATURES) == set(CALLED_BY), "every callable function has its callers declared"


def _refuse(message: str, args: str, op: str = "p_op", needs: str = "''") -> str:
    """A RAISE of insufficient_privilege whose DETAIL the client reads (postgres_roles)."""
    text = message.replace("'", "''")
    return (
        f"RAISE EXCEPTION '{text}'{', ' + args if args else ''} USING ERRCODE = '42501', "
        f"DETAIL = '{REFUSAL_MARK}; op=' || {op} || '; needs=' || {needs}"
    )


def _sd(schema: str) -> str:
    """How every callable function runs: as its owner, on the deployment's schema only."""
    return f"SECURITY DEFINER SET search_path = {quote_ident(schema).as_string(None)}, pg_temp"


_TABLES = """
CREATE TABLE IF NOT EXISTS rl_operations (
    op    text PRIMARY KEY,
    roles text[] NOT NULL,
    edges text[] NOT NULL,
    kinds text[] NOT NULL,
    parts text[] NOT NULL,
    bad   boolean NOT NULL
);
ALTER TABLE rl_operations ADD COLUMN IF NOT EXISTS updates text[] NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS every boolean NOT NULL DEFAULT false;
CREATE TABLE IF NOT EXISTS rl_roles (
    role text PRIMARY KEY,
    name text NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS rl_logins (
    login     text NOT NULL,
    role      text NOT NULL,
    worker_id text,
    PRIMARY KEY (login, role),
    CHECK ((role = 'worker') = (worker_id IS NOT NULL))
);
"""


def _helpers() -> str:
    """Internal functions (no caller may EXECUTE them: they run inside the callable ones)."""
    return f"""
CREATE OR REPLACE FUNCTION rl_is(p_role text) RETURNS boolean
LANGUAGE plpgsql STABLE AS $fn$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM rl_roles) THEN
        RETURN true;  -- roles off: one login does everything
    END IF;
    RETURN EXISTS (SELECT 1 FROM rl_roles r WHERE r.role = p_role
                   AND pg_has_role(session_user, r.name, 'USAGE'));
END
$fn$;
CREATE OR REPLACE FUNCTION rl_refuse_op(p_op text) RETURNS void
LANGUAGE plpgsql STABLE AS $fn$
DECLARE
    o rl_operations;
BEGIN
    -- why `_CHECK` found nothing: an unknown operation, or none of its roles is the login's
    SELECT * INTO o FROM rl_operations WHERE op = p_op;
    IF NOT FOUND THEN
        {_refuse("rollout-lifecycle knows no operation %", "p_op")};
    END IF;
    {
        _refuse(
            "login % has no role that may run %",
            "session_user, p_op",
            needs="array_to_string(o.roles, CASE WHEN o.every THEN '+' ELSE ',' END)",
        )
    };
END
$fn$;
CREATE OR REPLACE FUNCTION rl_reservable() RETURNS bigint[]
LANGUAGE plpgsql STABLE AS $fn$
BEGIN
    IF to_regclass('registry_pointer') IS NULL THEN
        RETURN NULL;  -- no registry: only the stamp itself is judged, by the client
    END IF;
    RETURN ARRAY({_RESERVABLE.format(version="a.version")} ORDER BY a.version);
END
$fn$;
CREATE OR REPLACE FUNCTION rl_not_poisoned(p_states text[], p_owners text[]) RETURNS void
LANGUAGE plpgsql STABLE AS $fn$
DECLARE
    v_bad text;
BEGIN
    -- rows going to 'reserved' for a poisoned update (the step held the update's lock)
    SELECT min(t.update_id) INTO v_bad
    FROM ledger_updates t
    WHERE t.status = 'poisoned' AND t.update_id IN (
        SELECT DISTINCT v.o FROM unnest(p_states, p_owners) AS v(s, o) WHERE v.s = 'reserved');
    IF v_bad IS NOT NULL THEN
        {_refuse("update % is poisoned: no rollout is reserved for it", "v_bad", op="'reserve'")};
    END IF;
END
$fn$;
CREATE OR REPLACE FUNCTION rl_append_events(
    p_kinds text[], p_subjects text[], p_payloads text[], p_counters json)
RETURNS TABLE (o_txn bigint, o_last bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    v_n bigint := coalesce(cardinality(p_kinds), 0);
BEGIN
    IF v_n = 0 THEN
        IF p_counters IS NOT NULL THEN
            INSERT INTO ledger_counters(name, shard, n)
            SELECT c.name, pg_backend_pid() % {COUNTER_SHARDS}, c.n
            FROM json_to_recordset(p_counters) AS c(name text, n bigint)
            ORDER BY c.name
            ON CONFLICT (name, shard) DO UPDATE SET n = ledger_counters.n + excluded.n;
        END IF;
        RETURN;
    END IF;
    IF p_counters IS NULL THEN
        RETURN QUERY {_plpgsql_append(counted=False)};
    ELSE
        RETURN QUERY {_plpgsql_append(counted=True)};
    END IF;
END
$fn$;
"""


def _plpgsql_append(*, counted: bool) -> str:
    """`append_events`'s statement over the function's parameters."""
    text = append_statement(counted=counted, result="t.txn, t.last FROM t")
    for name, var in (
        ("%(key)s", str(K_EVENTS)),
        ("%(n)s", "v_n"),
        ("%(kinds)b", "p_kinds"),
        ("%(subjects)b", "p_subjects"),
        ("%(payloads)b", "p_payloads"),
        ("%(counters)s", "p_counters"),
        ("%%", "%"),
    ):
        text = text.replace(name, var)
    return text.strip()


# The operation's row, found only when one of its roles is the login's (roles off, no
# `rl_roles` rows: any login), in ONE statement at the start of every callable function
# (a call of a checking function cost three times as much); `rl_refuse_op` says why not.
_CHECK = """
    SELECT op.* INTO o FROM rl_operations op
    WHERE op.op = p_op AND (
        SELECT CASE WHEN count(*) = 0 THEN true
                    WHEN op.every THEN coalesce(bool_and(CASE WHEN r.role = ANY(op.roles)
                        THEN pg_has_role(session_user, r.name, 'USAGE') ELSE true END), false)
                    ELSE coalesce(bool_or(CASE WHEN r.role = ANY(op.roles)
                        THEN pg_has_role(session_user, r.name, 'USAGE') ELSE false END), false)
               END
        FROM rl_roles r);
    IF NOT FOUND THEN
        PERFORM rl_refuse_op(p_op);
    END IF;"""


# The versions whose rollouts may be reserved now (`{version}`: one of them): ever active,
# not retired, within the recorded policy's max_lag of the pointer; none without a pointer
# or a policy. The facts `model.rules.reservation_refusal` judges, read by the server.
_RESERVABLE = (
    "SELECT a.version FROM registry_artifacts a, registry_pointer p, registry_policy l "
    "WHERE p.id = 1 AND l.id = 1 AND a.version = {version} "
    "AND a.version BETWEEN p.version - l.max_lag AND p.version "
    f"AND a.state = ANY({_WAS_ACTIVE}) "
    "AND NOT (a.state = 'rolled_back' "
    f"AND (a.failure::json ->> 'cause') IS DISTINCT FROM '{ROLLBACK_KEPT}')"
)


def _kinds_check() -> str:
    return f"""
    IF EXISTS (SELECT 1 FROM unnest(p_kinds) k WHERE NOT k = ANY(o.kinds)) THEN
        {_refuse("operation % may not record events of kinds %", "p_op, p_kinds")};
    END IF;"""


def _common(schema: str) -> str:
    sd = _sd(schema)
    return f"""
CREATE OR REPLACE FUNCTION rl_mark(p_token text) RETURNS void
LANGUAGE plpgsql VOLATILE {sd} AS $fn$
BEGIN
    -- only a transaction that wrote something has an id, and leaves a mark
    INSERT INTO commit_marks(token) SELECT p_token
    WHERE pg_current_xact_id_if_assigned() IS NOT NULL;
END
$fn$;
CREATE OR REPLACE FUNCTION rl_prune_marks() RETURNS void
LANGUAGE plpgsql VOLATILE {sd} AS $fn$
BEGIN
    DELETE FROM commit_marks WHERE at < now() - interval '1 day';
END
$fn$;
CREATE OR REPLACE FUNCTION {CHAIN_CHECK}() RETURNS void
LANGUAGE plpgsql VOLATILE {sd} AS $fn$
BEGIN
    PERFORM {CHAIN_PREV}();  -- HistoryTampered (its SQLSTATE) on an edited history
END
$fn$;
CREATE OR REPLACE FUNCTION rl_append(
    p_op text, p_kinds text[], p_subjects text[], p_payloads text[], p_counters json,
    p_updates json)
RETURNS TABLE (o_txn bigint, o_last bigint)
LANGUAGE plpgsql VOLATILE {sd} AS $fn$
DECLARE
    o rl_operations;
    v_bad text;
BEGIN{_CHECK}{_kinds_check()}
    IF p_updates IS NOT NULL THEN
        -- the update records the step leaves: each a change the operation makes, from the
        -- status stored now (the step holds each update's lock: `_lock_updates`)
        -- each record looked up by its key (a join with the step's JSON was planned as a
        -- scan of every update the run ever recorded: a step's cost grew with the run)
        SELECT min(u.u || ' (' || coalesce(u.t, 'unrecorded') || ' to ' || u.s || ')')
        INTO v_bad
        FROM (SELECT x.u, x.s, (SELECT t.status FROM ledger_updates t WHERE t.update_id = x.u) AS t
              FROM json_to_recordset(p_updates) AS x(u text, s text, c text, d text)) AS u
        WHERE NOT (coalesce(u.t, '') || '>' || u.s) = ANY(o.updates);
        IF v_bad IS NOT NULL THEN
            {_refuse("operation % may not change update %", "p_op, v_bad")};
        END IF;
        INSERT INTO ledger_updates(update_id, status, cause, detail)
        SELECT u.u, u.s, u.c, u.d
        FROM json_to_recordset(p_updates) AS u(u text, s text, c text, d text)
        ORDER BY u.u
        ON CONFLICT (update_id) DO UPDATE SET status = excluded.status,
            cause = excluded.cause, detail = excluded.detail;
    END IF;
    RETURN QUERY SELECT * FROM rl_append_events(p_kinds, p_subjects, p_payloads, p_counters);
END
$fn$;
"""


def update_document(updates: Sequence[UpdateChange]) -> str:
    """The update records a step leaves, as `rl_append`'s p_updates reads them."""
    return json.dumps(
        [{"u": a.update_id, "s": a.status, "c": a.cause, "d": a.detail} for _, _, a in updates]
    )


def _cas_many_body() -> str:
    """`CAS_MANY` over the function's own names (read at call time: a mutant may patch it)."""
    return re.sub(r"%\((\w+)\)b", lambda m: _CAS_VARS[m.group(1)], CAS_MANY).strip()


# The one-call reservation (p_guard 3), inside the write-one function after the premise
# lock: it writes only where `model.ledger.plan_reserve` would certainly plan this very
# write, and answers 'moved' (nothing written: the client runs the full path, whose own
# read gives every refusal) on any doubt. The request (`p_premise`, JSON, see
# `model.sql_unit.one_call_request`): the stamp's version, current version, max_lag and
# max_drift (the stamp alone was judged by the client), the row's expected text between
# ',"state":' and ',"reward":' (rewarded at the expected revision, no owner, no lease),
# the stamp's JSON, the tail of the event's payload and the lease's seconds (NULL:
# `p_lease` is the deadline, from an injected clock); the key layouts `read_entry` trusts
# are constants of the definition.
# `p_entry` and `p_payload` carry the texts before the lease's value; the lease is the
# server's clock plus the seconds, written as Python's repr writes it (a shortest
# round-trip decimal; any other form of the float8's text is a doubt). The splice is
# `model.sql_unit.splice_entry`'s, for a row whose stamp is null.
# the key layouts `read_entry` trusts ("field:key,...", '' the entry's own) and the
# fields that hold nested records: identifiers, commas and colons only
_SHAPES_SQL = "ARRAY[" + ", ".join(f"'{x}'" for x in STORED_SHAPES) + "]::text[]"
_NESTED_SQL = "ARRAY[" + ", ".join(f"'{x}'" for x in sorted(NESTED_IN_ENTRY)) + "]::text[]"
assert all(re.fullmatch(r"[a-z_:,]+", x) for x in STORED_SHAPES)
_ONE_CALL = f"""\
        SELECT * INTO q FROM json_to_record(p_premise::json) AS x(
            version bigint, stamp_current bigint, max_lag bigint, max_drift float8,
            before text, admission text, tail text, seconds float8);
        IF v_rev IS DISTINCT FROM p_expected OR v_was IS DISTINCT FROM 'rewarded'
           OR v_version IS DISTINCT FROM q.version THEN
            RETURN 'moved';
        END IF;
        -- the layout `splice_entry` reads: first ',"state":', the first ',"reward":'
        -- after it, the last ',"releases":', with ',"admission":null' right before it
        v_i := strpos(v_entry, ',"state":');
        v_j := strpos(substr(v_entry, v_i + 1), ',"reward":') + v_i;
        v_k := strpos(reverse(v_entry), reverse(',"releases":'));
        IF v_i = 0 OR v_j = v_i OR v_k = 0 THEN
            RETURN 'moved';
        END IF;
        v_k := length(v_entry) - v_k - length(',"releases":') + 2;
        IF v_k - 17 < v_j OR substr(v_entry, v_k - 17, 17) <> ',"admission":null'
           OR substr(v_entry, v_i, v_j - v_i) IS DISTINCT FROM q.before THEN
            RETURN 'moved';
        END IF;
        -- a shape `read_entry` trusts, at the top and in each nested record, and the
        -- row's artifact hash, in one pass over the stored text
        SELECT string_agg(t.k, ',' ORDER BY t.i),
               bool_and(t.k <> ALL({_NESTED_SQL}) OR json_typeof(t.v) = 'null'
                   OR (json_typeof(t.v) = 'object' AND (t.k || ':' || coalesce((
                       SELECT string_agg(x.k, ',' ORDER BY x.i)
                       FROM json_object_keys(t.v) WITH ORDINALITY AS x(k, i)), ''))
                       = ANY({_SHAPES_SQL}))),
               max(t.v #>> '{{}}') FILTER (WHERE t.k = 'artifact_hash')
        INTO v_keys, v_ok, v_digest
        FROM json_each(v_entry::json) WITH ORDINALITY AS t(k, v, i);
        IF v_ok IS NOT TRUE OR (':' || coalesce(v_keys, '')) <> ALL({_SHAPES_SQL}) THEN
            RETURN 'moved';
        END IF;
        -- `reservation_refusal` with the registry's facts now (none: only the stamp);
        -- nested: the registry's tables are planned only where they exist
        IF to_regclass('registry_pointer') IS NOT NULL THEN
            IF NOT EXISTS (
                SELECT 1 FROM registry_artifacts a, registry_pointer p, registry_policy l,
                    registry_artifacts c
                WHERE p.id = 1 AND l.id = 1 AND a.version = v_version
                  AND a.version IN ({_RESERVABLE.format(version="v_version")})
                  AND q.max_lag <= l.max_lag AND q.max_drift <= l.max_drift
                  AND a.artifact_hash = v_digest
                  AND c.version = q.stamp_current AND c.state = ANY({_WAS_ACTIVE})
                  AND p.version - v_version BETWEEN 0 AND least(q.max_lag, l.max_lag))
            THEN
                RETURN 'moved';
            END IF;
        END IF;
        IF q.seconds IS NOT NULL THEN
            p_lease := extract(epoch FROM clock_timestamp())::float8 + q.seconds;
        END IF;
        v_lease := p_lease::text;
        IF v_lease !~ '^[0-9]+[.][0-9]+$' OR v_lease::float8 <> p_lease THEN
            RETURN 'moved';
        END IF;
        p_entry := substr(v_entry, 1, v_i - 1) || p_entry || v_lease
            || substr(v_entry, v_j, v_k - 17 - v_j) || ',"admission":' || q.admission
            || substr(v_entry, v_k);
        p_payload := p_payload || v_lease || q.tail;"""


_SD = "@SECURITY_DEFINER@"  # where the write-one template says how it runs


def _write_one_template() -> str:
    """The write-one function's definition (`WRITE_ONE`), `_SD` standing for how it runs."""
    sd = _SD
    reserving = "p_state = 'reserved' AND v_was IS DISTINCT FROM 'reserved'"
    return f"""
CREATE OR REPLACE FUNCTION {WRITE_ONE}({", ".join(f"{n} {t}" for n, t in WRITE_ONE_ARGS)})
RETURNS text LANGUAGE plpgsql VOLATILE {sd} AS $fn$
DECLARE
    o rl_operations;
    v_txn bigint;
    v_seq bigint;
    v_prev bytea;
    v_hash bytea;
    v_was text;
    v_rev bigint;
    v_version bigint;
    v_update text;
    v_entry text;
    q record;
    v_i integer;
    v_j integer;
    v_k integer;
    v_lease text;
    v_keys text;
    v_ok boolean;
    v_digest text;
    v_asked bigint[];
BEGIN{_CHECK}
    IF NOT p_kind = ANY(o.kinds) THEN
        {_refuse("operation % may not record events of kind %", "p_op, p_kind")};
    END IF;
    IF p_guard = 3 THEN  -- the one-call reservation splices the row's stored text
        SELECT state, revision, behavior_version, entry INTO v_was, v_rev, v_version, v_entry
        FROM rollouts WHERE rollout_id = p_rollout_id;
    ELSE
        SELECT state, revision, behavior_version INTO v_was, v_rev, v_version
        FROM rollouts WHERE rollout_id = p_rollout_id;
    END IF;
    IF p_guard > 0 OR {reserving} THEN
        PERFORM pg_advisory_xact_lock_shared({K_PREMISE}, hashtext(current_schema()));
    END IF;
    IF p_state = 'rewarded' AND v_was IS DISTINCT FROM 'rewarded' THEN
        -- a row entering 'rewarded' waits out a retire_stale in flight (K_REWARDED)
        PERFORM pg_advisory_xact_lock_shared({K_REWARDED}, hashtext(current_schema()));
    END IF;
    IF p_guard = 3 THEN
{_ONE_CALL}
    END IF;
    IF p_guard = 1 AND to_regclass('registry_pointer') IS NOT NULL THEN
        RETURN 'moved';
    END IF;
    IF p_guard = 2 THEN  -- nested: the registry's tables are planned only where they exist
        -- the premise of the versions the peeked text names (a text naming none reads as
        -- one that moved: the reservation then takes a step)
        v_asked := ARRAY(SELECT x::bigint FROM json_array_elements_text(CASE
            WHEN json_typeof(p_premise::json -> 4) = 'array' THEN p_premise::json -> 4 END) x);
        IF {premise_sql("v_asked")} IS DISTINCT FROM p_premise THEN
            RETURN 'moved';
        END IF;
    END IF;
    -- a reservation writes only while its update is recorded and not poisoned (whatever
    -- the caller passed: the reserving row names its update)
    v_update := coalesce(p_update, CASE WHEN {reserving} THEN p_reserved_by END);
    IF v_update IS NOT NULL THEN  -- shared: a step that poisons it waits for this write
        PERFORM pg_advisory_xact_lock_shared(
            {K_UPDATE}, hashtext(current_schema() || '/' || v_update));
        IF NOT EXISTS (
            SELECT 1 FROM ledger_updates WHERE update_id = v_update AND status <> 'poisoned'
        ) THEN
            RETURN 'moved';
        END IF;
    END IF;
    IF v_rev IS DISTINCT FROM p_expected THEN
        RETURN 'lost';
    END IF;
    IF NOT (v_was || '>' || p_state) = ANY(o.edges) THEN
        {
        _refuse(
            "operation % may not move rollout % from % to %", "p_op, p_rollout_id, v_was, p_state"
        )
    };
    END IF;
    -- nested: the registry's tables are planned only where they exist (without a registry
    -- only the stamp itself is judged, by the client)
    IF {reserving} AND to_regclass('registry_pointer') IS NOT NULL THEN
        IF NOT EXISTS ({_RESERVABLE.format(version="v_version")}) THEN
            {
        _refuse(
            "rollout % of v% may not be reserved now: not within the recorded policy of "
            "the active version, never active, or retired",
            "p_rollout_id, v_version",
        )
    };
        END IF;
    END IF;
{CAS_STEP}    PERFORM pg_advisory_xact_lock({K_EVENTS}, hashtext(current_schema()));
    v_txn := nextval('events_txn');
    v_seq := nextval('events_seq');
    v_prev := {CHAIN_PREV}();
    v_hash := sha256(v_prev || {
        chain_message("v_seq", "v_txn", "p_kind", "p_rollout_id", "p_payload")
    });
    INSERT INTO events(seq, txn, kind, subject, payload, prev_hash, hash)
    VALUES (v_seq, v_txn, p_kind, p_rollout_id, p_payload, v_prev, v_hash);
    UPDATE events_chain SET last_seq = v_seq, last_hash = v_hash WHERE id = 1;
    INSERT INTO ledger_counters(name, shard, n)
    SELECT c.name, pg_backend_pid() % {COUNTER_SHARDS}, c.n
    FROM unnest(p_names, p_counts) AS c(name, n)
    ORDER BY c.name
    ON CONFLICT (name, shard) DO UPDATE SET n = ledger_counters.n + excluded.n;
    INSERT INTO commit_marks(token) VALUES (p_token);
    IF p_guard = 3 THEN
        RETURN p_entry;  -- the row as written: the client needs no other read
    END IF;
    RETURN 'won';
END
$fn$;
"""


# The single write's definition, as mutants and test builds edit it (`patch_everywhere`
# rebinds every global bound to it: WRITE_ONE_DDL and WRITE_ONE name the edited one, and
# functions_ddl creates it next to the program's own, kept in `_CANONICAL`)
WRITE_ONE_DDL = _write_one_template()
_CANONICAL = {"name": WRITE_ONE, "ddl": WRITE_ONE_DDL}


def _write_one(schema: str) -> str:
    """The single write's function, and an edited variant of it under its own name."""
    sd = _sd(schema)
    out = _CANONICAL["ddl"].replace(_SD, sd)
    if _CANONICAL["name"] != WRITE_ONE or WRITE_ONE_DDL is not _CANONICAL["ddl"]:
        out += WRITE_ONE_DDL.replace(_SD, sd)
    return out


def _ledger(schema: str) -> str:
    sd = _sd(schema)
    return f"""
CREATE OR REPLACE FUNCTION rl_write_rows(
    p_op text, p_ids text[], p_expected bigint[], p_states text[], p_revisions bigint[],
    p_owners text[], p_leases double precision[], p_entries text[])
RETURNS SETOF text LANGUAGE plpgsql VOLATILE {sd} AS $fn$
DECLARE
    o rl_operations;
    v_edges text[];
    v_versions bigint[];
    v_won bigint;
    v_bad text;
BEGIN{_CHECK}
    v_edges := o.edges;
    IF 'rewarded>reserved' = ANY(v_edges) THEN  -- the premise, under its lock
        PERFORM pg_advisory_xact_lock_shared({K_PREMISE}, hashtext(current_schema()));
        v_versions := rl_reservable();
        PERFORM rl_not_poisoned(p_states, p_owners);
    END IF;
    RETURN QUERY {_cas_many_body()};
    GET DIAGNOSTICS v_won = ROW_COUNT;
    IF v_won < cardinality(p_ids) THEN
        -- a row not written whose revision is still the expected one was refused, not
        -- lost (the rows just written carry their new revision)
        SELECT min(v.id || ' (' || r.state || ' to ' || v.state || ', v' || r.behavior_version
                   || ')') INTO v_bad
        FROM rollouts r JOIN unnest(p_ids, p_expected, p_states) AS v(id, expected, state)
            ON r.rollout_id = v.id
        WHERE r.revision = v.expected;
        IF v_bad IS NOT NULL THEN
            {
        _refuse(
            "operation % may not make this change: rollout %, not an edge of the operation "
            "or a version that may not be reserved now",
            "p_op, v_bad",
        )
    };
        END IF;
    END IF;
END
$fn$;
CREATE OR REPLACE FUNCTION rl_lock_rows(
    p_op text, p_which text, p_text text, p_number double precision, p_states text[])
RETURNS SETOF text LANGUAGE plpgsql VOLATILE {sd} AS $fn$
DECLARE
    o rl_operations;
BEGIN{_CHECK}
    -- the rows a step reads to write, locked in rollout_id order (see SqlUnit.select)
    IF p_which = 'owned' THEN
        RETURN QUERY SELECT entry FROM rollouts WHERE reserved_by = p_text
            ORDER BY rollout_id FOR UPDATE;
    ELSIF p_which = 'due' THEN
        RETURN QUERY SELECT entry FROM rollouts WHERE reserved_by IS NOT NULL
            AND lease_expires_at IS NOT NULL AND lease_expires_at <= p_number
            ORDER BY rollout_id FOR UPDATE;
    ELSIF p_which = 'of_version' THEN
        RETURN QUERY SELECT entry FROM rollouts WHERE behavior_version = p_number::bigint
            AND state = ANY(p_states) ORDER BY rollout_id FOR UPDATE;
    ELSIF p_which = 'ids' THEN  -- p_text: the ids, a JSON array
        RETURN QUERY SELECT entry FROM rollouts
            WHERE rollout_id = ANY(ARRAY(SELECT json_array_elements_text(p_text::json)))
            ORDER BY rollout_id FOR UPDATE;
    ELSIF p_which = 'older_than' THEN
        RETURN QUERY SELECT entry FROM rollouts WHERE behavior_version < p_number
            AND state = ANY(p_states) ORDER BY rollout_id FOR UPDATE;
    ELSE
        RAISE EXCEPTION 'rl_lock_rows: unknown selection %', p_which;
    END IF;
END
$fn$;
CREATE OR REPLACE FUNCTION rl_insert_rows(p_op text, p_doc json)
RETURNS SETOF text LANGUAGE plpgsql VOLATILE {sd} AS $fn$
DECLARE
    o rl_operations;
    v_bad text;
    v_moves boolean;
    v_versions bigint[];
BEGIN{_CHECK}
    -- after the check has read the operation (a DECLARE default would see o still NULL)
    v_moves := EXISTS (SELECT 1 FROM unnest(o.edges) e WHERE e NOT LIKE '>%');
    IF '>reserved' = ANY(o.edges) THEN  -- a landing reserved in its own step: the premise
        PERFORM pg_advisory_xact_lock_shared({K_PREMISE}, hashtext(current_schema()));
        v_versions := rl_reservable();
        PERFORM rl_not_poisoned(
            ARRAY(SELECT n.state FROM json_to_recordset(p_doc) AS n(state text)),
            ARRAY(SELECT n.reserved_by FROM json_to_recordset(p_doc) AS n(reserved_by text)));
    END IF;
    SELECT min(n.rollout_id || ' (' || n.state || ', revision ' || n.revision || ')')
    INTO v_bad FROM json_to_recordset(p_doc)
        AS n(rollout_id text, state text, revision bigint, reserved_by text, version bigint)
    -- a new rollout starts at revision 0 (one of a bad version is quarantined on arrival);
    -- an operation that also moves it in its step (a landing) at most a few steps on; only
    -- a reserved one has an owner, of a version reservable now
    WHERE NOT ('>' || n.state) = ANY(o.edges)
       OR (n.reserved_by IS NOT NULL) <> (n.state = 'reserved')
       OR (n.state = 'reserved' AND v_versions IS NOT NULL
           AND NOT n.version = ANY(v_versions))
       OR CASE WHEN v_moves THEN n.revision NOT BETWEEN 0 AND 3
               ELSE n.revision <> CASE WHEN n.state = 'quarantined' THEN 1 ELSE 0 END END;
    IF v_bad IS NOT NULL THEN
        {_refuse("operation % may not add rollout %", "p_op, v_bad")};
    END IF;
    RETURN QUERY
        INSERT INTO rollouts AS t(rollout_id, state, revision, reserved_by, lease_expires_at,
                                  behavior_version, entry)
        SELECT * FROM json_to_recordset(p_doc)
            AS n(rollout_id text, state text, revision bigint, reserved_by text, lease float8,
                 version bigint, entry text)
        ORDER BY rollout_id
        ON CONFLICT (rollout_id) DO NOTHING
        RETURNING t.rollout_id;
END
$fn$;
CREATE OR REPLACE FUNCTION rl_bad_version(
    p_op text, p_version bigint, p_reason text, p_mark boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE {sd} AS $fn$
DECLARE
    o rl_operations;
BEGIN{_CHECK}
    -- true when a row was written (the step then records it: RowRecorded)
    IF NOT o.bad THEN
        {_refuse("operation % does not mark versions bad", "p_op")};
    END IF;
    IF p_mark THEN
        INSERT INTO ledger_bad_versions(version, reason) VALUES (p_version, p_reason)
        ON CONFLICT (version) DO NOTHING;
        RETURN FOUND;
    END IF;
    -- lifting a mark: the operator's choice, or a coordinator's for a version it activated
    -- (nested: the registry's table is planned only where it exists)
    IF NOT rl_is('operator') THEN
        IF to_regclass('registry_artifacts') IS NULL THEN
            {
        _refuse(
            "v% is not active: only the operator lifts its mark", "p_version", needs="'operator'"
        )
    };
        ELSIF NOT EXISTS (SELECT 1 FROM registry_artifacts WHERE version = p_version
                          AND state = 'active') THEN
            {
        _refuse(
            "v% is not active: only the operator lifts its mark", "p_version", needs="'operator'"
        )
    };
        END IF;
    END IF;
    DELETE FROM ledger_bad_versions WHERE version = p_version;
    RETURN FOUND;
END
$fn$;
"""


def _registry(schema: str) -> str:
    sd = _sd(schema)
    return f"""
CREATE OR REPLACE FUNCTION rl_registry_write(
    p_op text, p_step json, p_kinds text[], p_subjects text[], p_payloads text[])
RETURNS TABLE (o_txn bigint, o_last bigint)
LANGUAGE plpgsql VOLATILE {sd} AS $fn$
#variable_conflict use_variable
DECLARE
    o rl_operations;
    a json;
    w json;
    v_part text;
    v_was text;
    v_me text;
    v_on boolean := false;
    v_ptr json := p_step -> 'pointer';
    v_version bigint;
    v_hash text;
    v_attempts bigint;
BEGIN{_CHECK}{_kinds_check()}
    FOR v_part IN SELECT json_object_keys(p_step) LOOP
        IF NOT v_part = ANY(o.parts) THEN
            {_refuse("operation % may not write the registry's %", "p_op, v_part")};
        END IF;
    END LOOP;
    -- no reservation reads the pointer, artifact states or policy while they change: a
    -- step changing one takes the premise lock exclusive before its first write
    IF p_step -> 'artifacts' IS NOT NULL OR p_step -> 'pointer' IS NOT NULL
       OR p_step -> 'policy' IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock({K_PREMISE}, hashtext(current_schema()));
    END IF;
    -- the pointer: only by an activation every required worker acked with its current
    -- token, or a rollback to the recorded rollback version (judged before any write)
    IF v_ptr IS NOT NULL THEN
        v_version := (v_ptr ->> 0)::bigint;
        v_hash := v_ptr ->> 1;
        IF NOT EXISTS (SELECT 1 FROM json_array_elements(p_step -> 'artifacts') x(c)
                       WHERE (x.c -> 'row' ->> 0)::bigint = v_version
                         AND x.c -> 'row' ->> 4 = 'active')
        THEN
            {
        _refuse("the pointer moves only to a version this step makes active, not v%", "v_version")
    };
        END IF;
        IF p_op = 'activate' THEN
            SELECT attempts INTO v_attempts FROM registry_artifacts
            WHERE version = v_version AND state = 'awaiting_acks' AND artifact_hash = v_hash;
            IF NOT FOUND OR NOT EXISTS (SELECT 1 FROM registry_membership WHERE id = 1)
               OR EXISTS (
                SELECT 1
                FROM registry_membership m,
                     json_array_elements_text(m.workers::json) AS req(worker_id)
                LEFT JOIN registry_workers rw ON rw.worker_id = req.worker_id
                LEFT JOIN registry_attempt_tokens t ON t.version = v_version
                    AND t.worker_id = req.worker_id AND t.attempt = v_attempts
                WHERE m.id = 1 AND (rw.ack IS NULL
                    OR (rw.ack::json ->> 'version')::bigint IS DISTINCT FROM v_version
                    OR (rw.ack::json ->> 'artifact_hash') IS DISTINCT FROM v_hash
                    OR t.token IS NULL
                    OR (rw.ack::json ->> 'token') IS DISTINCT FROM t.token))
            THEN
                {
        _refuse(
            "v% may become active only once every required worker acked it with its current token",
            "v_version",
        )
    };
            END IF;
        ELSIF p_op = 'rollback' THEN
            -- the active version steps down in this step, and its recorded rollback
            -- version comes back
            IF NOT EXISTS (
                SELECT 1 FROM registry_pointer p
                JOIN registry_artifacts cur ON cur.version = p.version
                JOIN registry_artifacts back ON back.version = cur.rollback_version
                WHERE p.id = 1 AND back.version = v_version AND back.artifact_hash = v_hash
                  AND EXISTS (SELECT 1 FROM json_array_elements(p_step -> 'artifacts') x(c)
                              WHERE (x.c -> 'row' ->> 0)::bigint = cur.version
                                AND x.c -> 'row' ->> 4 = 'rolled_back'))
            THEN
                {
        _refuse("a rollback returns to the recorded rollback version, not v%", "v_version")
    };
            END IF;
        END IF;
    END IF;
    FOR a IN SELECT * FROM json_array_elements(p_step -> 'artifacts') LOOP
        SELECT state INTO v_was FROM registry_artifacts WHERE version = (a -> 'row' ->> 0)::bigint;
        IF NOT (coalesce(v_was, '') || '>' || (a -> 'row' ->> 4)) = ANY(o.edges) THEN
            {
        _refuse(
            "operation % may not move artifact v% from % to %",
            "p_op, a -> 'row' ->> 0, coalesce(v_was, 'nothing'), a -> 'row' ->> 4",
        )
    };
        END IF;
        IF v_was IS NULL THEN
            INSERT INTO registry_artifacts(version, artifact_hash, parent_version,
                rollback_version, state, path, failure, attempts, trained_by, ack_deadline)
            SELECT (r ->> 0)::bigint, r ->> 1, (r ->> 2)::bigint, (r ->> 3)::bigint, r ->> 4,
                   r ->> 5, r ->> 6, (r ->> 7)::bigint, r ->> 8, (r ->> 9)::float8
            FROM (SELECT a -> 'row' AS r) x;
        ELSE
            UPDATE registry_artifacts SET artifact_hash = r ->> 1,
                parent_version = (r ->> 2)::bigint, rollback_version = (r ->> 3)::bigint,
                state = r ->> 4, path = r ->> 5, failure = r ->> 6,
                attempts = (r ->> 7)::bigint, trained_by = r ->> 8,
                ack_deadline = (r ->> 9)::float8
            FROM (SELECT a -> 'row' AS r) x
            WHERE version = (r ->> 0)::bigint;
        END IF;
    END LOOP;
    IF v_ptr IS NOT NULL THEN
        INSERT INTO registry_pointer(id, version, artifact_hash) VALUES (1, v_version, v_hash)
        ON CONFLICT (id) DO UPDATE SET version = excluded.version,
            artifact_hash = excluded.artifact_hash;
    END IF;
    IF p_op = 'report' THEN
        -- a worker reports for the worker id its login is mapped to, and no other
        SELECT EXISTS (SELECT 1 FROM rl_roles), (SELECT l.worker_id FROM rl_logins l
               WHERE l.login = session_user AND l.role = 'worker')
        INTO v_on, v_me;
    END IF;
    IF p_op = 'report' AND v_on THEN
        IF v_me IS NULL OR EXISTS (
            SELECT 1 FROM json_array_elements(p_step -> 'workers') x(w)
            WHERE x.w ->> 0 IS DISTINCT FROM v_me)
        THEN
            {
        _refuse(
            "login % reports as worker %, and for no other worker",
            "session_user, coalesce(v_me, '(none: not mapped)')",
            needs="'worker'",
        )
    };
        END IF;
    END IF;
    FOR w IN SELECT * FROM json_array_elements(p_step -> 'workers') LOOP
        IF p_op = 'report' AND (w ->> 2) IS NOT NULL
           AND ((w ->> 2)::json ->> 'token') IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM registry_attempt_tokens t
            WHERE t.version = ((w ->> 2)::json ->> 'version')::bigint
              AND t.worker_id = w ->> 0 AND t.token = ((w ->> 2)::json ->> 'token'))
        THEN
            {
        _refuse(
            "an ack of % is stored with a token only if it is that worker's current one",
            "w ->> 0",
        )
    };
        END IF;
        -- a token counts once: an ack echoing a spent one is never stored again (one kept
        -- as it was, a restart's, is no new ack)
        IF (w ->> 2) IS NOT NULL AND ((w ->> 2)::json ->> 'token') IS NOT NULL AND EXISTS (
            SELECT 1 FROM registry_attempt_tokens t
            WHERE t.version = ((w ->> 2)::json ->> 'version')::bigint
              AND t.worker_id = w ->> 0 AND t.token = ((w ->> 2)::json ->> 'token')
              AND t.spent)
           AND (SELECT rw.ack FROM registry_workers rw WHERE rw.worker_id = w ->> 0)
               IS DISTINCT FROM w ->> 2
        THEN
            {
        _refuse(
            "an ack of % echoes a token already counted once; a token counts once",
            "w ->> 0",
        )
    };
        END IF;
        INSERT INTO registry_workers(worker_id, floor, ack)
        VALUES (w ->> 0, (w ->> 1)::bigint, w ->> 2)
        ON CONFLICT (worker_id) DO UPDATE SET floor = excluded.floor, ack = excluded.ack;
    END LOOP;
    IF p_step -> 'revoked' IS NOT NULL THEN  -- a membership change: (not every step, whose
        -- empty list was still joined with every token the run ever issued)
        DELETE FROM registry_attempt_tokens
        WHERE worker_id = ANY(ARRAY(SELECT json_array_elements_text(p_step -> 'revoked')));
    END IF;
    -- a token is issued unspent; the acks this step stores spend the tokens they echo
    INSERT INTO registry_attempt_tokens(version, worker_id, attempt, token, spent)
    SELECT (t ->> 0)::bigint, t ->> 1, (t ->> 2)::bigint, t ->> 3, false
    FROM json_array_elements(p_step -> 'tokens') AS x(t)
    ON CONFLICT (version, worker_id) DO UPDATE SET attempt = excluded.attempt,
        token = excluded.token, spent = false;
    -- one lookup by key per stored ack (a join with the step's JSON was planned as a scan
    -- of every token the run ever issued: an ack's cost grew with the run)
    FOR w IN SELECT * FROM json_array_elements(p_step -> 'workers') LOOP
        IF (w ->> 2) IS NOT NULL AND ((w ->> 2)::json ->> 'token') IS NOT NULL THEN
            UPDATE registry_attempt_tokens SET spent = true
            WHERE version = ((w ->> 2)::json ->> 'version')::bigint AND worker_id = w ->> 0
              AND token = (w ->> 2)::json ->> 'token';
        END IF;
    END LOOP;
    IF p_step -> 'membership' IS NOT NULL THEN
        INSERT INTO registry_membership(id, workers)
        VALUES (1, (p_step -> 'membership')::text)
        ON CONFLICT (id) DO UPDATE SET workers = excluded.workers;
    END IF;
    IF p_step -> 'policy' IS NOT NULL THEN
        INSERT INTO registry_policy(id, max_lag, max_drift, batch_size, max_attempts,
                                    lineage, chain_key)
        SELECT 1, (pl ->> 0)::bigint, (pl ->> 1)::float8, (pl ->> 2)::bigint,
               (pl ->> 3)::bigint, pl ->> 4, pl ->> 5
        FROM (SELECT p_step -> 'policy' AS pl) x
        ON CONFLICT (id) DO UPDATE SET max_lag = excluded.max_lag,
            max_drift = excluded.max_drift, batch_size = excluded.batch_size,
            max_attempts = excluded.max_attempts, lineage = excluded.lineage,
            chain_key = excluded.chain_key;
    END IF;
    RETURN QUERY SELECT * FROM rl_append_events(p_kinds, p_subjects, p_payloads, NULL);
END
$fn$;
"""


def functions_ddl(schema: str) -> str:
    """Every function (and the tables the role checks read), created or replaced; the
    callable ones closed to PUBLIC (their owner, and the roles granted, may call them)."""
    quote_ident(schema)
    revoke = "".join(
        f"REVOKE ALL ON FUNCTION {name}({sig}) FROM PUBLIC;\n" for name, sig in SIGNATURES.items()
    )
    return (
        _TABLES
        + _helpers()
        + _common(schema)
        + _write_one(schema)
        + _ledger(schema)
        + _registry(schema)
        + revoke
    )


def functions_version(ddl: str) -> int:
    """The hash of a set of definitions, as `schema_meta` records it."""
    return zlib.crc32(ddl.encode()) & 0x7FFFFFFF


def _current(conn: Conn, version: int) -> bool:
    """Whether this schema holds exactly this program's functions."""
    row = conn.execute(
        "SELECT to_regclass('schema_meta') IS NOT NULL AND to_regclass('rl_operations') IS NOT NULL"
    ).fetchone()
    if row is None or not row[0]:
        return False
    found = conn.execute(
        "SELECT version FROM schema_meta WHERE component = %s", (COMPONENT,)
    ).fetchone()
    if found is None or int(found[0]) != version:
        return False
    sigs = [f"{n}({s})" for n, s in SIGNATURES.items()]
    row = conn.execute(
        "SELECT bool_and(to_regprocedure(s) IS NOT NULL) FROM unnest(%s::text[]) s", (sigs,)
    ).fetchone()
    return bool(row and row[0])


# every callable function's overloads, dropped before the definitions run again (a
# changed signature or return type cannot be replaced in place)
_DROP = """
DO $$ DECLARE r record; BEGIN
  FOR r IN SELECT p.oid::regprocedure AS sig FROM pg_proc p
    WHERE p.pronamespace = current_schema()::regnamespace AND p.proname = ANY(%s::text[])
      AND (p.oid <> ALL(%s::oid[]) OR (p.proname = 'rl_bad_version'
                                        AND p.prorettype = 'void'::regtype)) LOOP
    EXECUTE format('DROP FUNCTION %s', r.sig);
  END LOOP;
END $$
"""


def install(conn: Conn, schema: str) -> None:
    """Create or replace the functions and the operations table in this transaction (the
    caller holds K_SCHEMA and may create in the schema)."""
    ddl = functions_ddl(schema)
    # other overloads of the callable functions (an older signature), and the names they
    # had before: dropped; the current ones are replaced in place (their grants stay)
    names = "ARRAY[" + ", ".join(f"'{n}'" for n in [*SIGNATURES, *OLD_NAMES]) + "]::text[]"
    keep = (
        "ARRAY[0"
        + "".join(f", coalesce(to_regprocedure('{n}({a})'), 0)" for n, a in SIGNATURES.items())
        + "]::oid[]"
    )
    conn.execute(_DROP.replace("%s::text[]", names, 1).replace("%s::oid[]", keep, 1))
    conn.execute(ddl)
    conn.execute("DELETE FROM rl_operations")
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO rl_operations(op, roles, edges, kinds, parts, bad, updates, every) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            operation_rows(),
        )
    version = functions_version(ddl)
    before = conn.execute(
        "SELECT version FROM schema_meta WHERE component = %s", (COMPONENT,)
    ).fetchone()
    conn.execute(
        "INSERT INTO schema_meta(component, version) VALUES (%s, %s) "
        "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
        (COMPONENT, version),
    )
    if before is None or int(before[0]) != version:
        # the row is recorded in the chain, as every schema_meta row is (`ledger check`)
        why = "created" if before is None else f"replaced {before[0]}"
        row = {"component": COMPONENT, "version": version}
        ev = row_event("schema_meta", COMPONENT, row, why, time.time())
        append_events(conn, [ev], op=None, stamped=False)


def ensure_functions(db: PostgresDatabase) -> None:
    """Create the functions where they are missing or differ from this program's (a new
    database, one made before them, or by another version); nothing when they match."""
    schema = db.schema
    if schema is None:
        raise LedgerError(f"{db.where}: no schema to create the ledger's functions in")
    version = functions_version(functions_ddl(schema))
    if db.read(lambda conn: _current(conn, version), "looking for the server-side functions"):
        return

    def body(conn: Conn) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (K_SCHEMA,))
        if not _current(conn, version):
            install(conn, schema)

    try:
        db.write(body, "creating the server-side functions", ddl=True)
    except LedgerError as exc:
        if "permission denied" not in str(exc) and "must be owner" not in str(exc):
            raise
        raise LedgerError(
            f"{db.where}: the schema's server-side functions are missing or out of date, and "
            f"this login may not create them ({exc}); run `rollout-lifecycle deployment "
            "roles --backend URL` as the deployment's administrator"
        ) from None


def callable_functions() -> list[str]:
    """The functions roles may be granted (the rest run only inside them)."""
    return list(SIGNATURES)
