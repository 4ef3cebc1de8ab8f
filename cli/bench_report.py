"""What `rollout-lifecycle bench` writes: the run, the Markdown tables and the PNG plot.

Imported only when the command runs (cli/bench_cmd.py holds its options), so the other
commands never load the measurement code.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from rollout_lifecycle.cli import benchmarks as B
from rollout_lifecycle.model.atomic import atomic_write

FILES = ("bench.json", "README.md", "admission.png")
POSTGRES_NOTE = (
    "PostgreSQL needs a server, so it is measured apart, the same way (single and batch CAS "
    "with 1 / 4 / 8 worker processes next to a plain UPDATE of the same rows in the same "
    "run): `python benchmarks/postgres_bench.py` starts a throwaway server; the figures are "
    "in [docs/postgres.md](../postgres.md)."
)


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def markdown(report: dict[str, Any], command: str) -> str:
    """The report as Markdown tables: goals first, then each part."""
    m = report["machine"]
    lines = [
        "# Benchmarks",
        "",
        "Measured side by side in one run (variants interleaved, best of the repeats), on "
        f"{m['cpus']} CPUs, Python {m['python']}, numpy {m['numpy']}, torch {m['torch'] or '-'}"
        f", verl {m['verl'] or 'not installed'}, SQLite {m['sqlite']}; load average at the "
        f"start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'] or [])}. Read the ratios, "
        "not the times: the machine is shared.",
        "",
        f"Produced by `{command}` "
        f"({'quick sizes, not comparable' if report['quick'] else 'full sizes'}, "
        f"{report['elapsed_s']} s).",
        "",
        "## Goals (issues 13 and 22)",
        "",
        "| goal | measured | target | met | load |",
        "|---|---:|---:|:---:|---:|",
    ]
    for g in report["goals"]:
        met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
        lines.append(
            f"| {g['goal']} | {_fmt(g['measured'])} | {g['target']} | {met} | "
            f"{_fmt(g.get('load1'))} |"
        )
    lines += [
        "",
        "load: the 1-minute load average when the figure was measured (- where the report "
        "predates it).",
    ]
    adm = report.get("admission")
    if adm:
        lines += [
            "",
            "## Admission",
            "",
            adm["what"] + ". Times in ms; ratios are gate_arrays over the baseline (or, for "
            "records and verl, the other way round: their time over the gate's).",
            "",
            "| library | B | T | gate arrays | gate records | bare | read-once | Python loop "
            "| verl | gate/bare | gate/read-once | records/arrays | verl/gate | peak mem gate "
            "| peak mem bare | load |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in adm["rows"]:
            ms, r, pk = row["ms"], row["ratios"], row["peak_extra_vs_inputs"]
            lines.append(
                f"| {row['library']} | {row['B']} | {row['T']} | {_fmt(ms['gate_arrays'])} | "
                f"{_fmt(ms['gate_records'])} | {_fmt(ms['bare'])} | {_fmt(ms['read_once'])} | "
                f"{_fmt(ms['python_loop'])} | {_fmt(ms.get('verl'))} | "
                f"{_fmt(r['arrays_vs_bare'])} | {_fmt(r['arrays_vs_read_once'])} | "
                f"{_fmt(r['records_vs_arrays'])} | {_fmt(r['verl_vs_arrays'])} | "
                f"{_fmt(pk['gate_arrays'], 3)}x | {_fmt(pk['bare'], 3)}x | "
                f"{_fmt(row.get('load1'))} |"
            )
        lines += ["", "Variants:", ""]
        lines += [f"- `{k}`: {v}" for k, v in adm["variants"].items()]
        lines += [
            "",
            f"Peak extra memory is relative to the inputs' bytes. numpy: {adm['memory']['numpy']}"
            f"; torch: {adm['memory']['torch']}. torch ran with {adm['torch_threads']} threads.",
        ]
        if adm["verl"] is None:
            lines.append("verl is not installed here: its column is empty.")
    led = report.get("ledgers")
    if led:
        lines += [
            "",
            "## Ledgers",
            "",
            "| backend | single CAS /s | batch /s (size) | batch/single | commits /s "
            "(ledger size) | baseline | load |",
            "|---|---:|---:|---:|---|---|---:|",
        ]
        for name, x in led.items():
            commits = ", ".join(f"{_fmt(v)} ({k})" for k, v in x["commits_per_s"].items())
            base = ", ".join(f"{k} {_fmt(v)}" for k, v in x["baseline"].items())
            lines.append(
                f"| {name} | {_fmt(x['single_per_s'])} | {_fmt(x['batch_per_s'])} "
                f"({x['batch_size']}) | {_fmt(x['ratios']['batch_vs_single'])} | {commits} | "
                f"{base} | {_fmt(x.get('load1'))} |"
            )
        lines += [
            "",
            "Each variant (the single CAS, the batch, their baselines) runs in a process of its "
            "own (forked, its garbage collector on, the parent's objects frozen), the parent "
            "ordering the turns: in one shared heap the batch, whose temporaries peak highest, "
            "was timed for the collections the singles' garbage triggered.",
        ]
        tmpfs = led.get("sqlite", {}).get("tmpfs")
        if tmpfs is not None:  # reports from before this measurement have none
            lines += [
                "",
                (
                    f"SQLite single CAS on tmpfs ({tmpfs['folder']}): "
                    f"{_fmt(tmpfs['single_per_s'])} /s; autocommit UPDATE "
                    f"{_fmt(tmpfs['baseline']['autocommit_update_per_s'])} /s (synchronous "
                    f"{tmpfs['baseline']['synchronous']})."
                    if tmpfs["measured"]
                    else f"SQLite single CAS on tmpfs: not measured ({tmpfs['why']})."
                ),
            ]
        lines += [
            "",
            "Racing threads (each reads a rollout, then tries a compare-and-set on it):",
            "",
            "| backend | threads | rollouts | wins | lost CAS | wins /s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, x in led.items():
            for r in x["racing"]:
                lines.append(
                    f"| {name} | {r['workers']} | {r['rollouts']} | {r['wins']} | "
                    f"{r['lost_cas']} | {_fmt(r['wins_per_s'])} |"
                )
        scale = led.get("memory", {}).get("scale")
        if scale:
            per_row = ", ".join(
                f"{k}: {_fmt(v)} ({_fmt(scale['wall_us_per_row'][k])} wall)"
                for k, v in scale["cpu_us_per_row"].items()
            )
            plain = ""
            if "plain_cpu_us_per_row" in scale:
                per_plain = ", ".join(
                    f"{k}: {_fmt(v)}" for k, v in scale["plain_cpu_us_per_row"].items()
                )
                plain = (
                    " The same rows written by hand in the same run (each entry evolved, "
                    "stored in a dict and logged as a tuple, no ledger), CPU us per row: "
                    f"{per_plain}; most / least "
                    f"{_fmt(scale['ratios']['plain_cpu_max_vs_min'])}."
                )
            lines += [
                "",
                f"Memory batch reservations ({scale['batch_size']}) as the ledger grows, "
                f"garbage collector on, CPU us per row by ledger size: {per_row}; most / "
                f"least {_fmt(scale['ratios'].get('cpu_max_vs_min'))}, largest ledger / "
                f"smallest {_fmt(scale['ratios']['cpu_largest_vs_smallest'])} (medians of "
                f"{scale['repeats']}).{plain}",
            ]
        lines += ["", POSTGRES_NOTE]
    chk = report.get("checkers")
    if chk:
        lines += ["", "## Checkers", ""]
        rerun = chk.get("rerun")
        if rerun:  # measured apart from the rest of the report: say when, how and why
            load = ", ".join(f"{x:.2f}" for x in rerun["loadavg_at_start"])
            lines += [
                f"Re-measured apart from the parts above, by `{rerun['command']}` "
                f"({rerun['elapsed_s']} s, load average at the start {load}): "
                f"{rerun['why']}",
                "",
            ]
        lines += ["| fuzz backend | machine | examples | steps | steps/s |"]
        lines.append("|---|---|---:|---:|---:|")
        for backend, runs in chk["fuzz"].items():
            for machine, r in runs.items():
                lines.append(
                    f"| {backend} | {machine} | {r['examples']} | {r['steps']} | "
                    f"{_fmt(r['steps_per_s'], 1)} |"
                )
        lines += ["", "| explorer model | distinct states | complete | states/s |"]
        lines.append("|---|---:|:---:|---:|")
        for name, r in chk["explore"].items():
            lines.append(
                f"| {name} | {r['distinct_states']} | {'yes' if r['complete'] else 'no'} | "
                f"{_fmt(r['states_per_s'], 1)} |"
            )
    if report.get("pacing"):
        from rollout_lifecycle.cli import pacing_sim

        lines += ["", *pacing_sim.markdown(report["pacing"])]
    from rollout_lifecycle.cli import bench_speed  # issue 22's parts, where they ran

    for block in bench_speed.markdown(report):
        lines += ["", *block]
    from rollout_lifecycle.cli import bench_fleet  # issue 36's fleet, where it ran

    fleet = bench_fleet.markdown(report)
    if fleet:
        lines += ["", *fleet]
    plot = report.get("plot")
    if plot:
        lines += ["", f"![admission times]({plot})"]
    elif report.get("admission"):  # the plot is of the admission part alone
        lines += ["", "(no plot: matplotlib is not installed)"]
    return "\n".join(lines) + "\n"


def plot_png(report: dict[str, Any]) -> bytes | None:
    """Admission times per case as grouped bars (log scale); None without matplotlib."""
    adm = report.get("admission")
    if not adm:
        return None
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    libs = sorted({r["library"] for r in adm["rows"]})
    names = ["gate_arrays", "gate_records", "bare", "read_once", "python_loop", "verl"]
    fig = Figure(figsize=(11, 3.6 * len(libs)), layout="constrained")
    axes = fig.subplots(len(libs), 1, squeeze=False)[:, 0]
    for ax, lib in zip(axes, libs, strict=True):
        rows = [r for r in adm["rows"] if r["library"] == lib]
        present = [n for n in names if any(r["ms"].get(n) is not None for r in rows)]
        width = 0.8 / max(1, len(present))
        for k, name in enumerate(present):
            xs = [i + (k - (len(present) - 1) / 2) * width for i in range(len(rows))]
            ys = [r["ms"].get(name) or 0.0 for r in rows]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(rows)), [f"B={r['B']}\nT={r['T']}" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms (best of repeats)")
        ax.set_title(f"admission, {lib}, float32")
        ax.legend(ncols=3, fontsize="small")
        ax.grid(axis="y", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def run_and_write(
    *,
    quick: bool,
    parts: Sequence[str],
    out: Path | None,
    report: Path | None,
    as_json: bool,
    command: str,
    progress: Callable[[str], None],
    fleet: dict[str, Any] | None = None,
) -> None:
    """Measure, then write the files (out=None: none) and print the JSON or a summary."""
    result = B.run(B.QUICK if quick else B.FULL, parts=parts, progress=progress, fleet=fleet)
    result["command"] = command
    png = None if out is None else plot_png(result)
    result["plot"] = "admission.png" if png is not None else None
    text = json.dumps(result, indent=2) + "\n"
    if out is not None:
        atomic_write(out / "bench.json", text)
        atomic_write(out / "README.md", markdown(result, command))
        if png is not None:
            atomic_write(out / "admission.png", png)
    if report is not None:
        atomic_write(report, text)
    if as_json:
        click.echo(text, nl=False)
        return
    met = [g for g in result["goals"] if g["met"]]
    missed = [g for g in result["goals"] if g["met"] is False]
    click.echo(f"bench: {len(met)} goals met, {len(missed)} missed, in {result['elapsed_s']} s")
    for g in missed:
        click.echo(f"  missed: {g['goal']}: {_fmt(g['measured'], 3)} (target {g['target']})")
    if out is not None:
        where = ", ".join(str(out / n) for n in FILES if (n != "admission.png" or png))
        click.echo(f"wrote {where}" + ("" if png else " (no PNG: matplotlib is not installed)"))
