"""No table of measured numbers is typed into the docs: each comes from bench/results/*.json.

A page asks for a measured table with ``<!-- table: NAME -->`` (docs/hooks/tables.py builds it at
build time), so in the Markdown as it is in the repository a measured table is only a marker. This
test reads every table of docs/*.md and README.md as written and fails on one that holds measured
quantities: a number with a unit of time, rate, bandwidth, percentage or ratio in a cell, or a
number under a header that names such a quantity (tokens/s, latency, TTFT, p50, ...). `ALLOWED`
lists the few typed tables whose numbers are settings or constants, not measurements, each with
why; an entry that no longer names such a table fails too, so the list cannot grow stale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

# (page, the first cell of the table's first row) -> why its numbers are not measurements.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/observability.md", "`GET /metrics`"): "the router's endpoints; '2 s' is how often the dashboard polls",
    ("docs/observability.md", "`baton:router_requests_admitted{pool}`"): (
        "metric definitions; '50 ms' is how often the event-loop lag is sampled"
    ),
    ("docs/structured-outputs.md", "`baton:structured_output_compile_seconds`"): (
        "metric definitions; '1 ms to 10 s' is the histogram's bucket range"
    ),
    ("docs/sim.md", "`lora_slot_load_s`"): (
        "the simulator's LoRA cost parameters: estimated defaults with their reasoning, not runs"
    ),
    ("docs/sim.md", "`nvlink`"): (
        "the simulator's KV-link presets: constants of the cost model (datasheet figures derated), not runs"
    ),
}

_NUM = r"[-+]?\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?:ms|s|µs|us|ns|min|tok/s|tokens/s|req/s|[GMK]i?B/s|Gb/s|%|x|×)"
# A number with a unit: "37.9 ms", "1.23x", "95%", "360 GB/s"; not "sm_80", "v1", "8MiB".
QUANTITY = re.compile(rf"(?<![\w.\-/]){_NUM}\s?{_UNIT}(?![\w/])")
# A header naming a measured quantity: its column's bare numbers are measurements too.
MEASURED_HEADER = re.compile(
    r"\((?:ms|s|µs|us|%|[GMK]i?B/s)\)|tok(?:en)?s/s|[GMK]i?B/s|\bms\b|latency|throughput|TTFT|TPOT|ITL|"
    r"speedup|hit rate|\bp\d\d\b|seconds|accepted|steps",
    re.IGNORECASE,
)
NUMBER_CELL = re.compile(rf"^\**{_NUM}\**(?:\s|$)")
DELIMITER_ROW = re.compile(r"^\s*\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


@dataclass
class Table:
    line: int
    header: list[str]
    rows: list[list[str]]

    @property
    def key(self) -> str:
        return self.rows[0][0] if self.rows and self.rows[0] else ""


def _cells(line: str) -> list[str]:
    s = line.strip()
    s = s[1:] if s.startswith("|") else s
    s = s[:-1] if s.endswith("|") and not s.endswith("\\|") else s
    return [c.strip() for c in re.split(r"(?<!\\)\|", s)]


def tables(markdown: str) -> list[Table]:
    """Every pipe table of `markdown` outside fenced code blocks."""
    lines, out, fence, i = markdown.splitlines(), [], None, 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif line.strip().startswith(fence):
                fence = None
        elif (
            fence is None and line.lstrip().startswith("|") and i + 1 < len(lines) and DELIMITER_ROW.match(lines[i + 1])
        ):
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            out.append(Table(i + 1, _cells(line), [_cells(r) for r in lines[i + 2 : j]]))
            i = j
            continue
        i += 1
    return out


def _text(cell: str) -> str:
    """A cell without its code spans and link targets: neither is a quantity."""
    return re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", cell)).strip()


def measured(table: Table) -> list[str]:
    """What in `table` reads as a measured quantity (empty: nothing)."""
    found = [m.group(0) for row in table.rows for cell in row for m in QUANTITY.finditer(_text(cell))]
    for k, head in enumerate(table.header):
        numbers = [row[k] for row in table.rows if k < len(row) and NUMBER_CELL.match(_text(row[k]))]
        if MEASURED_HEADER.search(_text(head)) and numbers:
            found.append(f"{head!r}: {', '.join(numbers[:3])}")
    return found


def typed_measured_tables(page: str, markdown: str, allowed: dict[tuple[str, str], str]) -> list[str]:
    return [
        f"{page}:{t.line}: a table of measured numbers typed into the page ({'; '.join(hits[:4])})"
        for t in tables(markdown)
        if (hits := measured(t)) and (page, t.key) not in allowed
    ]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", PAGES, ids=_rel)
def test_no_measured_table_is_typed_into_a_page(path):
    bad = typed_measured_tables(_rel(path), path.read_text(), ALLOWED)
    assert not bad, (
        "\n".join(bad) + "\nGenerate it from bench/results/*.json: a builder t_NAME in docs/hooks/tables_*.py "
        "and <!-- table: NAME --> in the page (docs/development.md, 'Documentation'); if its numbers are "
        "settings or constants, not measurements, add it to ALLOWED in this file saying why."
    )


@pytest.mark.parametrize("page,key", sorted(ALLOWED))
def test_every_allowed_table_is_still_there_and_still_looks_measured(page, key):
    found = [t for t in tables((ROOT / page).read_text()) if t.key == key]
    assert found, f"ALLOWED names a table of {page} starting with {key!r} that is no longer there: remove the entry"
    assert any(measured(t) for t in found), f"{page}: the table starting with {key!r} needs no entry in ALLOWED"


# -- the check itself can fail -----------------------------------------------------------------

TYPED = """\
Measured on the development VM:

| run | tokens/s | TTFT p50 |
|---|---:|---:|
| plain | 37.9 | 120 ms |
"""

# docs/speculative-decoding.md's step-cost table as it was typed: no unit in any cell, only in the header.
TYPED_UNITS_IN_HEADER = """\
| batch | ngram / plain tokens/s | steps with drafts | drafts accepted |
|---:|---:|---:|---:|
| 4 | 0.98 | 41 of 989 | 18 of 55 |
"""

NOT_MEASURED = """\
| key | meaning | default |
|---|---|---|
| `max_tokens` | tokens at most per reply | `16` |
| `model` | the model folder, sm_80 or v1 | none |
"""


def test_a_typed_measured_table_fails():
    assert typed_measured_tables("x.md", TYPED, {})
    assert typed_measured_tables("x.md", TYPED_UNITS_IN_HEADER, {})
    assert "x.md:3:" in typed_measured_tables("x.md", TYPED, {})[0]


def test_a_marker_a_code_block_a_settings_table_and_an_allowed_table_pass():
    assert not typed_measured_tables("x.md", "Measured:\n\n<!-- table: engine_throughput -->\n", {})
    assert not typed_measured_tables("x.md", "```text\n" + TYPED + "```\n", {})
    assert not typed_measured_tables("x.md", NOT_MEASURED, {})
    assert not typed_measured_tables("x.md", TYPED, {("x.md", "plain"): "an example"})
    assert typed_measured_tables("y.md", TYPED, {("x.md", "plain"): "an example"})  # the entry is per page


def test_tables_are_read_as_written():
    (t,) = tables("text\n\n| a | b \\| c |\n|---|---|\n| 1 | `3 ms` [2 ms](x.md#4-ms) 5 ms |\n\nafter | not a table\n")
    assert t.header == ["a", "b \\| c"] and t.key == "1" and t.line == 3
    assert measured(t) == ["2 ms", "5 ms"]  # not the code span's, not the link target's
