"""docs/guide.md stays true: every command block runs, with the exit code and output shown.

How the guide is read (the convention is stated in the guide's closing note too):

- a ```console block holds commands, each on a line starting with ``$ ``, followed by the
  output the guide shows for it; ``$ echo $?`` is followed by the previous command's exit
  status (every other command must exit 0);
- a ```python block runs as a script (``python block.py``) and must exit 0; a ```text
  block right after it is the output it shows;
- ```sh and other blocks are not run (install lines, a PostgreSQL URL);
- the shown output is checked line by line: every shown line, except a line that is just
  ``...`` (output left out), must appear in the real output (stdout, then stderr), in the
  same order, ignoring trailing spaces;
- an HTML comment ``<!-- guide: numbers vary -->`` right before a block marks output whose
  figures change from run to run (timings, counts of a timed race, random tokens): there,
  on both sides, every run of digits (with ``,`` and ``.``) becomes ``#``, every hex string
  of 8 or more characters becomes ``HEX``, runs of spaces and of table rules collapse to one,
  so the words, names, reasons and table layout are still checked.

Each ``## `` section of the guide runs in its own fresh folder ``guide-run/`` (beside a
link ``docs`` to the checkout's docs, so ``../docs/...`` works as it does for a reader who
runs the guide from a ``guide-run`` folder in the checkout), with this interpreter's bin
folder first on PATH and COLUMNS=100 (tables are as wide as the guide shows them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
README = ROOT / "README.md"
COMMAND_TIMEOUT_S = 300
LOOSE = "numbers vary"

_FENCE = re.compile(r"^```([a-z]*)\s*$")
_DIRECTIVE = re.compile(r"<!--\s*guide:\s*(.*?)\s*-->")
_NUMBER = re.compile(r"\d[\d,.]*")
_HEX = re.compile(r"\b[0-9a-f]{8,}\b")
_RULES = re.compile(r"([─━═┄-])\1+")
_SPACES = re.compile(r"\s+")


@attrs.frozen
class Step:
    """One thing to run: a shell command or a Python script, with the output shown for it."""

    kind: str  # "shell" or "python"
    source: str
    shown: tuple[str, ...]
    exit_code: int
    loose: bool
    line: int  # line of the guide where its block starts

    def label(self) -> str:
        """Where it is in the guide, and what it is."""
        head = self.source.strip().splitlines()[0] if self.source.strip() else ""
        return f"guide.md:{self.line}: {head[:80]}"


@attrs.frozen
class Block:
    """A fenced block: its language, body lines, the line it starts on, its directives."""

    lang: str
    body: tuple[str, ...]
    line: int
    directives: tuple[str, ...]


def parse_blocks(text: str) -> list[tuple[str, list[Block]]]:
    """The guide's ``## `` sections, each with its fenced blocks in order."""
    sections: list[tuple[str, list[Block]]] = [("preamble", [])]
    lines = text.splitlines()
    pending: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
            pending = []
        found = _DIRECTIVE.search(line)
        if found:
            pending.append(found.group(1))
        fence = _FENCE.match(line)
        if fence:
            start = i + 1
            j = start
            while j < len(lines) and lines[j].rstrip() != "```":
                j += 1
            if j == len(lines):
                raise AssertionError(f"guide.md:{i + 1}: unclosed code block")
            body = tuple(lines[start:j])
            sections[-1][1].append(Block(fence.group(1), body, i + 1, tuple(pending)))
            pending = []
            i = j + 1
            continue
        if line.strip() and not found:
            pending = []
        i += 1
    return sections


def console_steps(block: Block) -> list[Step]:
    """The commands of a ```console block, each with its shown output and exit status."""
    loose = LOOSE in block.directives
    steps: list[Step] = []
    command: str | None = None
    out: list[str] = []
    start = block.line
    for n, line in enumerate(block.body, start=block.line + 1):
        if line.startswith("$ "):
            if command is not None:
                steps.append(Step("shell", command, tuple(out), 0, loose, start))
            command, out, start = line[2:], [], n
        elif command is None:
            raise AssertionError(f"guide.md:{n}: output before any '$ ' command")
        else:
            out.append(line)
    if command is not None:
        steps.append(Step("shell", command, tuple(out), 0, loose, start))
    # `$ echo $?` shows the exit status of the command before it; it is not run itself
    result: list[Step] = []
    for step in steps:
        if step.source.strip() == "echo $?":
            if not result or len(step.shown) != 1 or not step.shown[0].strip().isdigit():
                raise AssertionError(f"guide.md:{step.line}: 'echo $?' needs one number after it")
            result[-1] = attrs.evolve(result[-1], exit_code=int(step.shown[0]))
        else:
            result.append(step)
    return result


def section_steps(blocks: list[Block]) -> list[Step]:
    """Every runnable step of one section, in order."""
    steps: list[Step] = []
    for k, block in enumerate(blocks):
        if block.lang == "console":
            steps.extend(console_steps(block))
        elif block.lang == "python":
            shown: tuple[str, ...] = ()
            nxt = blocks[k + 1] if k + 1 < len(blocks) else None
            if nxt is not None and nxt.lang == "text" and _adjacent(block, nxt):
                shown = nxt.body
            loose = LOOSE in block.directives or (
                nxt is not None and nxt.lang == "text" and LOOSE in nxt.directives
            )
            steps.append(Step("python", "\n".join(block.body) + "\n", shown, 0, loose, block.line))
    return steps


def _adjacent(block: Block, nxt: Block) -> bool:
    """A text block shows a python block's output when only prose-free lines lie between."""
    text = GUIDE.read_text(encoding="utf-8").splitlines()
    between = text[block.line + len(block.body) + 1 : nxt.line - 1]
    return all(not ln.strip() or _DIRECTIVE.search(ln) for ln in between)


def normalise(line: str, loose: bool) -> str:
    """A line as compared: trailing space dropped; in loose blocks, figures masked."""
    line = line.rstrip()
    if loose:
        line = _HEX.sub("HEX", line)
        line = _NUMBER.sub("#", line)
        line = _RULES.sub(r"\1", line)
        line = _SPACES.sub(" ", line).strip()
    return line


def missing_lines(shown: tuple[str, ...], real: str, loose: bool) -> list[str]:
    """Shown lines not found in the real output in order (empty when the guide is true)."""
    have = [normalise(ln, loose) for ln in real.splitlines()]
    pos = 0
    missing: list[str] = []
    for line in shown:
        want = normalise(line, loose)
        if line.strip() == "..." or not want:
            continue
        try:
            pos = have.index(want, pos) + 1
        except ValueError:
            missing.append(line)
    return missing


def environment() -> dict[str, str]:
    """The reader's shell: the venv's bin first on PATH, tables 100 columns wide."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "100"
    return env


def run_step(step: Step, work: Path) -> subprocess.CompletedProcess[str]:
    """Run one step in `work` as the reader would."""
    if step.kind == "python":
        script = work / f".guide-block-{step.line}.py"
        script.write_text(step.source, encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-c", step.source]
    return subprocess.run(
        argv,
        cwd=work,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def make_workdir(base: Path) -> Path:
    """guide-run/ beside a `docs` link to the checkout's docs (for ../docs/... paths)."""
    (base / "docs").symlink_to(ROOT / "docs", target_is_directory=True)
    work = base / "guide-run"
    work.mkdir()
    return work


def check_section(steps: list[Step], work: Path) -> list[str]:
    """Run every step; return one message per difference between the guide and reality."""
    problems: list[str] = []
    for step in steps:
        t0 = time.perf_counter()
        res = run_step(step, work)
        real = res.stdout + res.stderr
        took = time.perf_counter() - t0
        if res.returncode != step.exit_code:
            problems.append(
                f"{step.label()}: exit {res.returncode}, the guide shows {step.exit_code} "
                f"({took:.1f}s)\n{real[-3000:]}"
            )
            continue
        missing = missing_lines(step.shown, real, step.loose)
        if missing:
            shown = "\n".join(f"    {ln}" for ln in missing[:8])
            problems.append(
                f"{step.label()}: shown lines not in the real output:\n{shown}\n"
                f"--- real output ---\n{real[-4000:]}"
            )
    return problems


SECTIONS = [(title, blocks) for title, blocks in parse_blocks(GUIDE.read_text("utf-8"))]
RUNNABLE = [(title, blocks) for title, blocks in SECTIONS if section_steps(blocks)]


def test_readme_links_the_guide() -> None:
    """The README sends a new reader to the guide."""
    assert re.search(r"\]\((\./)?docs/guide\.md\)", README.read_text("utf-8"))


def test_guide_has_runnable_blocks_in_every_part() -> None:
    """The seven parts exist and each has something that runs (nothing is prose-only)."""
    numbered = [title for title, _ in SECTIONS if re.match(r"\d\. ", title)]
    assert len(numbered) == 7, numbered
    runnable = {title for title, _ in RUNNABLE}
    assert set(numbered) <= runnable, set(numbered) - runnable


def test_parser_sees_output_and_exit_codes() -> None:
    """The checker can fail: a wrong line, a wrong order, a wrong exit code are caught."""
    block = Block("console", ("$ false", "$ echo $?", "1", "$ echo a; echo b", "a", "b"), 1, ())
    steps = console_steps(block)
    assert [(s.source, s.exit_code) for s in steps] == [("false", 1), ("echo a; echo b", 0)]
    assert missing_lines(("a", "...", "b"), "a\nx\nb\n", False) == []
    assert missing_lines(("b", "a"), "a\nb\n", False) == ["a"]
    assert missing_lines(("took 1.5s",), "took 2.25s\n", False) == ["took 1.5s"]
    assert missing_lines(("│ x │   12 │",), "│ x │ 1,234 │\n", True) == []
    assert missing_lines(("│ y │ 12 │",), "│ x │ 12 │\n", True) == ["│ y │ 12 │"]


@pytest.mark.parametrize("title,blocks", RUNNABLE, ids=[t.split(":")[0] for t, _ in RUNNABLE])
def test_guide_section_runs_as_shown(title: str, blocks: list[Block], tmp_path: Path) -> None:
    """Every command and script of the section exits as shown and prints what is shown."""
    work = make_workdir(tmp_path)
    problems = check_section(section_steps(blocks), work)
    assert not problems, f"section {title!r} drifted from the code:\n\n" + "\n\n".join(problems)
