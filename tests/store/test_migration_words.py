"""How migrate names a change still being made (its progress, retries, a change given up on):
every kind of step a plan makes has its words."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import room_outbox.store.schema
from room_outbox.store.schema.outbox import IN_PROGRESS, in_progress, silk_key_steps

SCHEMA = Path(room_outbox.store.schema.__file__).parent


def _leading_text(node: ast.expr) -> str | None:
    """A string literal's text, an f-string's up to its first placeholder; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
    return None


def _changes(tree: ast.AST) -> list[tuple[int, str]]:
    """The changes (line, text) the planners of a module write: ``Migration(change, …)`` and
    ``concurrent_step(change, …)``, ``changes.append(change)`` (steps of several changes), and
    ``(change, statements)`` tuples (columns' and buckets' steps)."""
    found: list[tuple[int, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("Migration", "concurrent_step"):
                found.append((node.lineno, node.args[0]))
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "changes":
                found.append((node.lineno, node.args[-1]))
        elif isinstance(node, ast.Tuple) and len(node.elts) >= 2:
            text = _leading_text(node.elts[0])
            # statements follow the change as a tuple, a call making them, or a name
            if text and text[:1].islower() and isinstance(node.elts[1], ast.Tuple | ast.Call | ast.Name):
                found.append((node.lineno, node.elts[0]))
    return [(line, text) for line, node in found if (text := _leading_text(node)) is not None]


def test_every_step_kind_has_its_words_in_progress() -> None:
    changes = {
        f"{path.name}:{line}": text
        for path in sorted(SCHEMA.glob("*.py"))
        for line, text in _changes(ast.parse(path.read_text(encoding="utf-8")))
    }
    assert len(changes) > 40  # the collector still finds the planners' changes
    unknown = {where: text for where, text in changes.items() if text.partition(" ")[0] not in IN_PROGRESS}
    assert unknown == {}, "a step's change starts with a word in_progress cannot turn: add it to IN_PROGRESS"


def test_silks_key_steps_read_right_in_progress() -> None:
    """The backfill's progress line: "numbering the rows already in outbox_events: 30 rows of 30"."""
    assert [in_progress(step.change) for step in silk_key_steps("outbox_events", 0)] == [
        "adding column outbox_events.outbox_seq",
        "numbering new rows of outbox_events above the rows already there",
        "adding index outbox_events.idx_outbox_events_outbox_seq_backfill",
        "numbering the rows already in outbox_events",
        "checking outbox_events.outbox_seq is set on new rows",
        "checking outbox_events.outbox_seq is set on every row",
        "making outbox_events.outbox_seq NOT NULL",
        "dropping the backfill's index and sequence of outbox_events",
    ]


@pytest.mark.parametrize("change", ["widened t.c", "lane kafka's table is fed"])
def test_a_change_without_its_words_is_still_named(change: str) -> None:
    assert in_progress(change) == f"not yet made: {change}"
