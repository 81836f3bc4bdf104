"""MkDocs hook: the state machines' diagrams and the end reasons, generated from the code's tables.

A page asks for one with an HTML comment on a line of its own::

    <!-- flow: request_states -->   router.flow.TRANSITIONS as a mermaid stateDiagram-v2
    <!-- flow: sequence_states -->  workers.engine.sequence.TRANSITIONS, the same way
    <!-- flow: end_reasons -->      router.flow_commands.EndReason: each value, retryable or not, meaning

Every edge of a diagram is an entry of its TRANSITIONS and every entry is an edge, so the docs show
exactly the moves the code checks. The start is the state a new flow or sequence has (the dataclass
field's default); the ends are the states with no move out. `LABELS` below only words some edges:
a label whose edge the table no longer has fails the build, so a label cannot outlive its move. An
end reason's meaning is the comment beside its enum member.

Like the other hooks it imports nothing of Baton: a child process (``python -m docs.hooks.flow``)
prints the tables as JSON. docs/hooks/__init__.py says why the sys.path line below is there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # MkDocs loads this file by its path; the child imports Baton from ROOT
    sys.path.insert(0, str(ROOT))

from docs.hooks.markers import marker, render_markers  # noqa: E402 (after the path line above)

PLACEHOLDER = marker("flow")

# Words on some edges, (from, to) -> label. Not every edge needs one: the moves to ABORTED and FAILED
# that every live state has go unlabelled.
LABELS: dict[str, dict[tuple[str, str], str]] = {
    "request_states": {
        ("ROUTED", "RESERVING"): "remote prefill",
        ("ROUTED", "DECODING"): "local prefill",
        ("RESERVING", "PREFILLING"): "blocks reserved on D",
        ("RESERVING", "DECODING"): "no room on D, D prefills",
        ("RESERVING", "MIGRATING"): "D lost",
        ("PREFILLING", "DECODING"): "first token and KV pushed, or D prefills",
        ("PREFILLING", "RESERVING"): "P lost, another P",
        ("PREFILLING", "FINISHED"): "one-token answer",
        ("PREFILLING", "MIGRATING"): "D lost",
        ("DECODING", "MIGRATING"): "D lost or drained",
        ("DECODING", "ABORTED"): "client gone",
        ("DECODING", "FAILED"): "past max_migrations, refused, or another failure",
        ("MIGRATING", "MIGRATING"): "waiting for a decode worker",
        ("MIGRATING", "DECODING"): "resubmitted with what the client has",
        ("MIGRATING", "FAILED"): "none within migration_wait_s",
    },
    "sequence_states": {
        ("WAITING", "RUNNING"): "scheduled",
        ("WAITING", "WAITING_FOR_KV"): "decode side, blocks reserved for a peer",
        ("WAITING_FOR_KV", "RUNNING"): "the peer's KV arrived",
        ("RUNNING", "WAITING"): "preempted, to be recomputed",
        ("RUNNING", "HELD_FOR_PEER"): "prefill side, prompt done",
        ("HELD_FOR_PEER", "SENDING_KV"): "a transfer reads the blocks",
        ("SENDING_KV", "FINISHED"): "the transfer ended",
    },
}


# -- the child: read the tables from the code ---------------------------------------------------


def _member_comments(cls: type) -> dict[str, str]:
    """The comment beside each `NAME = value` line of an enum class's source."""
    import inspect

    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+([A-Z_][A-Z0-9_]*)\s*=[^#]*#\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _machine(transitions: dict[Any, frozenset[Any]], initial: Any) -> dict[str, Any]:
    order = list(transitions)  # the enum's order, as the table lists it
    return {
        "initial": initial.name,
        "transitions": {s.name: [t.name for t in order if t in nxt] for s, nxt in transitions.items()},
    }


def dump() -> dict[str, Any]:
    """The tables, as plain data (runs in the child process)."""
    import dataclasses
    import inspect

    from router import flow, flow_commands
    from workers.engine import sequence

    def default(cls: type, name: str) -> Any:
        return next(fld.default for fld in dataclasses.fields(cls) if fld.name == name)

    comments = _member_comments(flow_commands.EndReason)
    return {
        "request_states": _machine(flow.TRANSITIONS, default(flow.RequestFlow, "state")),
        "sequence_states": _machine(sequence.TRANSITIONS, default(sequence.Sequence, "status")),
        "end_reasons": [
            {"name": r.name, "value": r.value, "retryable": r.retryable, "meaning": comments.get(r.name, "")}
            for r in flow_commands.EndReason
        ],
        "retryable_means": inspect.getdoc(flow_commands.EndReason.retryable),
    }


@cache
def tables() -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "docs.hooks.flow"], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300
    )
    return json.loads(out.stdout)


# -- rendering ---------------------------------------------------------------------------------


def state_diagram(machine: dict[str, Any], labels: dict[tuple[str, str], str] | None = None) -> str:
    """A mermaid stateDiagram-v2 with every move of `machine` (see `dump`) and nothing else."""
    labels = labels or {}
    transitions: dict[str, list[str]] = machine["transitions"]
    edges = {(s, t) for s, nxt in transitions.items() for t in nxt}
    stale = sorted(set(labels) - edges)
    if stale:
        raise KeyError(f"labels for moves the table does not have: {stale}")
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {machine['initial']}"]
    for s, nxt in transitions.items():
        for t in nxt:
            label = labels.get((s, t))
            if label is not None and re.search(r"[:;#\n]", label):
                raise ValueError(f"{s} -> {t}: a mermaid label cannot hold ':', ';', '#' or a newline: {label!r}")
            lines.append(f"    {s} --> {t}" + (f": {label}" if label else ""))
    lines += [f"    {s} --> [*]" for s, nxt in transitions.items() if not nxt]
    return "\n".join(lines + ["```"])


def end_reasons_table(reasons: list[dict[str, Any]], retryable_means: str = "") -> str:
    rows = [f"| `{r['value']}` | {'yes' if r['retryable'] else 'no'} | {r['meaning']} |" for r in reasons]
    note = f"\n\nRetryable: {retryable_means[0].lower()}{retryable_means[1:]}" if retryable_means else ""
    return "\n".join(["| end reason | retryable | meaning |", "|---|---|---|", *rows]) + note


def build(name: str) -> str:
    data = tables()
    if name == "end_reasons":
        return end_reasons_table(data["end_reasons"], data["retryable_means"])
    if name in LABELS:
        return state_diagram(data[name], LABELS[name])
    raise KeyError(f"no flow content named {name!r} (known: end_reasons, {', '.join(sorted(LABELS))})")


def render(markdown: str, where: str = "") -> str:
    return render_markers(PLACEHOLDER, build, markdown, where)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown, page.file.src_path)


if __name__ == "__main__":
    print(json.dumps(dump()))
