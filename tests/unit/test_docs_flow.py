"""The docs' state diagrams and end-reason table are the code's tables (docs/hooks/flow.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from router.flow import TRANSITIONS as FLOW_TRANSITIONS
from router.flow import FlowState
from router.flow_commands import EndReason
from workers.engine.sequence import TRANSITIONS as SEQUENCE_TRANSITIONS
from workers.engine.sequence import SequenceStatus

ROOT = Path(__file__).resolve().parents[2]


def _flow():
    spec = importlib.util.spec_from_file_location("baton_docs_flow", ROOT / "docs" / "hooks" / "flow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flow = _flow()
EDGE = re.compile(r"^    (\S+) --> (\S+?)(?::.*)?$", re.MULTILINE)


def _edges(diagram: str) -> set[tuple[str, str]]:
    return set(EDGE.findall(diagram))


@pytest.mark.parametrize(
    "name,transitions,start",
    [
        ("request_states", FLOW_TRANSITIONS, FlowState.ROUTED),
        ("sequence_states", SEQUENCE_TRANSITIONS, SequenceStatus.WAITING),
    ],
)
def test_the_diagram_has_every_move_of_the_table_and_no_other(name, transitions, start):
    diagram = flow.build(name)
    assert diagram.startswith("```mermaid\nstateDiagram-v2\n") and diagram.endswith("\n```")
    moves = {(s.name, t.name) for s, nxt in transitions.items() for t in nxt}
    ends = {(s.name, "[*]") for s, nxt in transitions.items() if not nxt}
    assert _edges(diagram) == moves | ends | {("[*]", start.name)}


def test_a_label_for_a_move_the_table_lacks_fails_the_build():
    machine = {"initial": "A", "transitions": {"A": ["B"], "B": []}}
    assert _edges(flow.state_diagram(machine, {("A", "B"): "go"})) == {("[*]", "A"), ("A", "B"), ("B", "[*]")}
    with pytest.raises(KeyError, match="B', 'A"):
        flow.state_diagram(machine, {("B", "A"): "back"})
    with pytest.raises(ValueError, match="mermaid label"):
        flow.state_diagram(machine, {("A", "B"): "go: now"})


def test_the_end_reasons_table_lists_every_reason_and_whether_it_is_retryable():
    rows = dict(re.findall(r"^\| `(\w+)` \| (yes|no) \|", flow.build("end_reasons"), re.MULTILINE))
    assert rows == {r.value: "yes" if r.retryable else "no" for r in EndReason}


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_flow_marker_builds(page):
    for name in flow.PLACEHOLDER.findall((ROOT / "docs" / page).read_text()):
        assert flow.build(name)


def test_no_page_draws_a_state_diagram_by_hand():
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert "<!-- flow: request_states -->" in architecture and "<!-- flow: end_reasons -->" in architecture
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert "stateDiagram" not in page.read_text(), f"{page.name}: use <!-- flow: NAME --> (docs/hooks/flow.py)"
