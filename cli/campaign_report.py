"""The campaign's figures in the README and docs/campaign.md, rendered from committed reports.

`docs/campaign/<profile>.json` is what `rollout-lifecycle campaign --profile <profile>
--report docs/campaign/<profile>.json` wrote on the development machine. Every figure the
README and docs/campaign.md quote about a campaign is rendered from those files, between
`<!-- campaign-figures: NAME -->` and `<!-- /campaign-figures -->` markers, by one command:

    python -m rollout_lifecycle.cli.campaign_report          # rewrite the blocks
    python -m rollout_lifecycle.cli.campaign_report --check  # exit 1 when one is stale

(`make campaign-docs` runs the first); tests/test_readme.py checks the blocks against the
reports, so a figure cannot drift from the run it came from.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout_lifecycle.stateful_tests.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]
REPORTS_DIR = Path("docs") / "campaign"
PROFILES_SHOWN = ("fast", "thorough")
MUTANTS_REPORT = "mutants-fast.json"
TARGETS = (Path("README.md"), Path("docs") / "campaign.md")
_BLOCK = re.compile(
    r"(<!-- campaign-figures: (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- /campaign-figures -->)",
    re.S,
)


def fmt_s(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _load(timing: Mapping[str, Any]) -> str:
    before, after = timing.get("load_before"), timing.get("load_after")
    if not before or not after:
        return "load not recorded"
    return f"load {before[0]:.1f} at the start, {after[0]:.1f} at the end"


def load_reports(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """The committed reports, by profile name."""
    out = {}
    for name in PROFILES_SHOWN:
        path = root / REPORTS_DIR / f"{name}.json"
        out[name] = json.loads(path.read_text(encoding="utf-8"))
    return out


def load_mutants(root: Path = ROOT) -> dict[str, Any]:
    """The committed `mutants --checker campaign` report (the fast profile's kills)."""
    data: dict[str, Any] = json.loads(
        (root / REPORTS_DIR / MUTANTS_REPORT).read_text(encoding="utf-8")
    )
    return data


def mutants_table(report: Mapping[str, Any]) -> str:
    """Per stage, how many mutants the campaign killed there; then each mutant's stage."""
    s = report["summary"]
    c = s["campaign"]
    lines = [
        f"`rollout-lifecycle mutants --checker campaign --profile {report['campaign_profile']} "
        f"--postgres URL`: {c['killed']} of {s['mutants']} mutants killed by the "
        f"{report['campaign_profile']} profile ({c['reached']} reached), "
        f"{len(s['survivors'])} survivors; median time to kill "
        f"{c['median_seconds_to_kill']:.1f} s. "
        "Kills by stage: "
        + ", ".join(f"{k} {n}" for k, n in s["campaign_kills_by_stage"].items())
        + "."
        + "".join(
            f" Not reached by this profile: {r['name']} ({r['campaign']['detail']})."
            for r in report["results"]
            if r["campaign"]["killed"] is None
        ),
        "",
        "| mutant | class | killed by the stage | after | s |",
        "|---|---|---|---:|---:|",
    ]
    for r in report["results"]:
        k = r["campaign"]
        after = "-" if k["effort"] is None else f"{k['effort']:,} {k['unit']}"
        by = (
            k.get("stage") or "?"
            if k["killed"]
            else "SURVIVED"
            if k["killed"] is False
            else f"not reached: {k['detail']}"
        )
        lines.append(f"| {r['name']} | {r['class']} | {by} | {after} | {k['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def _reach(r: Mapping[str, Any]) -> dict[str, Any]:
    cov = r["coverage"]["machines"]
    edges = sum(c["covered"] for c in cov.values()), sum(c["declared"] for c in cov.values())
    some = r["fuzz"]["sometimes"]
    reached = sum(1 for n in some.values() if n), len(some)
    states = sum(m["distinct_states"] for m in (r["explore"] or {"models": {}})["models"].values())
    missed = sum(len(v) for v in r["goals_missed"].values())
    return {"edges": edges, "sometimes": reached, "states": states, "missed": missed}


def _budget(r: Mapping[str, Any]) -> str:
    """The fuzz budget as the profile states it: a cut per machine, or Hypothesis's own."""
    b = r["budget"]
    if b.get("cut", True):
        return "cut at " + ", ".join(f"{m} {n}" for m, n in r["examples"].items())
    return f"max_examples {b['max_examples']} per machine"


def profiles_table(reports: Mapping[str, Mapping[str, Any]]) -> str:
    """The README's table: each profile's measured time and what it reaches."""
    lines = [
        "| profile | measured (2 cores) | CPU time | fuzz examples | explorer | race "
        "| other stages | verdict |",
        "|---|---|---:|---|---|---|---|---|",
    ]
    for name, r in reports.items():
        t = r["timing"]
        got = _reach(r)
        fuzz = r["fuzz"]
        ex_models = list((r["explore"] or {"models": {}})["models"])
        race = r["race"]
        verdict = (
            f"{r['violations']} violations"
            if r["violations"]
            else f"{got['missed']} goals missed"
            if got["missed"]
            else "exit 0"
        )
        lines.append(
            f"| `{name}` | {fmt_s(t['wall_s'])} ({_load(t)}) | {fmt_s(t['cpu_s'])} | "
            f"{sum(run['examples'] for run in fuzz['runs'].values()):,} ({_budget(r)}): "
            f"edges {got['edges'][0]}/{got['edges'][1]}, sometimes-properties "
            f"{got['sometimes'][0]}/{got['sometimes'][1]} | "
            f"{len(ex_models)} models, {got['states']:,} states | "
            + (
                f"{race['config']['seconds']:.0f} s, {race['calls_judged']:,} calls judged"
                if race
                else "skipped"
            )
            + f" | {_others(r)} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def _others(r: Mapping[str, Any]) -> str:
    """The interleavings and the targeted stages in a few words: what ran, what did not."""
    parts = []
    scripted = r.get("interleavings")
    if scripted is not None:
        wrong = sum(len(v) for v in scripted.values())
        parts.append(f"interleavings {len(scripted) - wrong}/{len(scripted)}")
    for st in r.get("stages", []):
        parts.append(f"{st['stage']} skipped" if st["skipped"] else st["stage"])
    off = [n for n in r.get("budget", {}).get("stages", []) if n in r.get("skipped", {})]
    if off:
        parts.append(f"not on {r['backend']}: {', '.join(off)}")
    return "; ".join(parts) or "-"


def _race_text(race: Mapping[str, Any]) -> str:
    t = race["totals"]
    refused = {
        k.split(":", 1)[1]: n
        for k, n in t.items()
        if k.startswith("dispatch:") and k != "dispatch:dispatched"
    }
    return (
        f"Race stage ({race['config']['learners']} learner processes, one of them "
        f"misconfigured, an activator that also rolls back, churns the worker set and "
        f"tightens the policy, and {race['config'].get('dispatchers', 0)} dispatchers, on "
        f"`{race['config']['url'].split('?')[0]}`, {race['config']['seconds']:.0f} s): "
        f"{race['events']:,} events, {race['calls_judged']:,} calls judged, "
        f"{t.get('activate:activated', 0):,} activations, {t.get('rolled_back', 0):,} "
        f"rollbacks ({t.get('rolled_back_kept', 0):,} keeping their rollouts), "
        f"{t.get('committed', 0):,} rollouts reserved and consumed, "
        f"{t.get('reserve:idempotent_retry', 0):,} idempotent retries, "
        f"{t.get('reserve:revision_conflict', 0):,} CAS conflicts, "
        f"{t.get('reserve:pointer_moved', 0):,} reservations refused as `pointer_moved` and "
        f"{t.get('reserve:looser_than_policy', 0):,} as `looser_than_policy`; "
        f"{t.get('dispatch:dispatched', 0):,} dispatches admitted and "
        f"{sum(refused.values()):,} refused"
        + (f" ({', '.join(f'{n:,} `{k}`' for k, n in sorted(refused.items()))})" if refused else "")
        + f", {t.get('retired_stale', 0):,} rollouts retired stale; "
        f"{race['violation_count']} violations."
        + (_lin_text(race["linearizability"]) if race.get("linearizability") else "")
    )


def _lin_text(lin: Mapping[str, Any]) -> str:
    return (
        f" The whole recorded history ({lin['calls']:,} calls, {lin['partitions']:,} "
        f"partitions, the largest {lin['max_partition']:,} calls) checked for "
        f"linearizability in {lin['seconds']:.1f} s: {lin['verdict']}."
    )


def _stage_lines(r: Mapping[str, Any]) -> list[str]:
    """The scripted interleavings and the targeted stages, one line each."""
    out = []
    scripted = r.get("interleavings")
    if scripted is not None:
        wrong = sum(len(v) for v in scripted.values())
        out.append(
            f"Interleavings stage: {len(scripted)} scripted gaps between two connections "
            f"({', '.join(scripted)}), {wrong} answers untrue at the instant of their step."
        )
    for st in r.get("stages", []):
        if st["skipped"]:
            out.append(f"{st['stage']} stage: SKIPPED ({st['skipped']}).")
            continue
        facts = ", ".join(
            f"{k} {v}" for k, v in st["facts"].items() if isinstance(v, (int, float, str))
        )
        out.append(
            f"{st['stage']} stage: {len(st['failures'])} violations in {st['seconds']:.1f} s"
            + (f" ({facts})." if facts else ".")
        )
    for name in r.get("budget", {}).get("stages", []):
        ran = any(st["stage"] == name for st in r.get("stages", []))
        if name in r.get("skipped", {}) and not ran and name in STAGES:
            where = "/".join(STAGES[name].backends)
            out.append(f"{name} stage: not run on {r['backend']} (it runs on {where} only).")
    return out


def _stages(t: Mapping[str, Any]) -> str:
    """Each stage's wall seconds, and its CPU seconds when the report has them."""
    cpu = t.get("stages_cpu_s")
    if not cpu:
        return "Stages: " + ", ".join(f"{k} {fmt_s(v)}" for k, v in t["stages_s"].items()) + "."
    return (
        "Stages (wall / CPU): "
        + ", ".join(f"{k} {fmt_s(v)} / {fmt_s(cpu.get(k, 0))}" for k, v in t["stages_s"].items())
        + "."
    )


def figures(r: Mapping[str, Any]) -> str:
    """One profile's figures for docs/campaign.md: every stage, as measured."""
    t = r["timing"]
    got = _reach(r)
    ck = r["checkers"]
    lines = [
        f"`rollout-lifecycle campaign --profile {r['profile']}` on {r['backend']}, seed "
        f"{r['seed']}: {'exit 0' if not r['violations'] and not got['missed'] else 'NOT clean'}"
        f" in {fmt_s(t['wall_s'])} of wall time and {fmt_s(t['cpu_s'])} of CPU time (this "
        f"process and its children), on {t['cpus']} cores, {_load(t)}. " + _stages(t),
        "",
        f"Checker stage: {ck['bad_cases']:,} known-bad and {ck['good_cases']:,} known-good "
        f"inputs ({', '.join(f'{k} {n}' for k, n in ck['cases'].items())}), "
        f"{len(ck['failures'])} got wrong.",
    ]
    ad = r["adapter"]
    if ad is not None:
        lines.append(
            f"verl adapter stage: {ad['batches']:,} generated batches ({ad['rows']:,} rows; "
            f"{', '.join(ad['kinds'])}), {len(ad['failures'])} disagreements with the "
            "reference gate."
        )
    else:
        lines.append(f"verl adapter stage: SKIPPED ({r['skipped'].get('adapter', '')}).")
    lines += [
        "",
        "| fuzz machine | examples | steps | steps/s | rules fired |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, run in r["fuzz"]["runs"].items():
        fired = sum(1 for n in run["rules"].values() if n > 0)
        lines.append(
            f"| {name} | {run['examples']:,} | {run['steps']:,} | {run['steps_per_s']:,.0f} | "
            f"{fired}/{len(run['rules'])} |"
        )
    cov = r["coverage"]["machines"]
    inv = r["fuzz"]["invariants"]
    lines += [
        "",
        "Declared edges exercised: "
        + ", ".join(f"{m} {c['covered']}/{c['declared']}" for m, c in cov.items())
        + f"; sometimes-properties reached: {got['sometimes'][0]}/{got['sometimes'][1]}; "
        f"{sum(inv.values()):,} invariant checks over {len(inv)} named invariants; "
        f"{r['violations']} violations.",
    ]
    if r["explore"] is not None:
        lines += [
            "",
            "| explorer model | distinct states | generated | depth | complete | violations | s |",
            "|---|---:|---:|---:|:---:|---:|---:|",
        ]
        for name, m in r["explore"]["models"].items():
            lines.append(
                f"| {name} | {m['distinct_states']:,} | {m['generated_states']:,} | "
                f"{m['max_depth']} | {'yes' if m['complete'] else 'no'} | "
                f"{len(m['violations'])} | {m['elapsed_s']:.1f} |"
            )
    if r["race"] is not None:
        lines += ["", _race_text(r["race"])]
    for line in _stage_lines(r):  # a paragraph each
        lines += ["", line]
    return "\n".join(lines) + "\n"


def blocks(reports: Mapping[str, Mapping[str, Any]], mutants: Mapping[str, Any]) -> dict[str, str]:
    """Every generated block's text, by marker name."""
    out = {"profiles": profiles_table(reports), "mutants": mutants_table(mutants)}
    for name, r in reports.items():
        out[name] = figures(r)
    return out


def rewrite(text: str, generated: Mapping[str, str]) -> str:
    """`text` with each marked block replaced by its generated text (unknown names kept)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group("name")
        body = generated.get(name, m.group("body"))
        return f"{m.group(1)}{body}{m.group(4)}"

    return _BLOCK.sub(sub, text)


def marked(text: str) -> dict[str, str]:
    """The marked blocks of `text`, by name."""
    return {m.group("name"): m.group("body") for m in _BLOCK.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check, verify) the generated blocks of the README and docs."""
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    generated = blocks(load_reports(ROOT), load_mutants(ROOT))
    stale = []
    for rel in TARGETS:
        path = ROOT / rel
        old = path.read_text(encoding="utf-8")
        new = rewrite(old, generated)
        if new != old:
            stale.append(str(rel))
            if not check:
                path.write_text(new, encoding="utf-8")
    if check and stale:
        print(
            f"stale campaign figures in {', '.join(stale)}: run "
            "python -m rollout_lifecycle.cli.campaign_report",
            file=sys.stderr,
        )
        return 1
    done = "checked" if check else f"written ({', '.join(stale) or 'no change'})"
    print(f"campaign figures {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
