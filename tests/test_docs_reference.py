"""The reference pages the code states are current, and the docs' facts about the code hold.

* ``scripts/docs_reference.py --check``: the command line, configuration and metrics pages and
  the envelope's JSON Schema match what the code would generate now.
* Every envelope shown as ``json`` in the docs satisfies that schema and parses as an envelope.
* ``mkdocs build --strict`` builds the site without a warning.
* Every module and folder the README's code map names exists.
* The sample outputs the how-tos show are what the commands print.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from room_outbox.cli.lanes import LaneRow, format_lanes
from room_outbox.envelope import parse_envelope

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"


def test_generated_reference_pages_are_current() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/docs_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def _json_blocks(page: Path) -> list[str]:
    return re.findall(r"^```json\n(.*?)^```", page.read_text(), flags=re.MULTILINE | re.DOTALL)


def _schema_errors(value: Any, schema: dict[str, Any], where: str = "envelope") -> list[str]:
    """What the JSON Schema keywords the envelope's schema uses (``type``, ``anyOf``,
    ``properties``, ``required``, ``additionalProperties``) find wrong in ``value``."""
    if "anyOf" in schema:
        if all(_schema_errors(value, option, where) for option in schema["anyOf"]):
            return [f"{where}: matches none of {schema['anyOf']}"]
        return []
    types = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
        "array": list,
        "null": type(None),
    }
    kind = schema.get("type")
    if kind is not None and (
        not isinstance(value, types[kind]) or (kind in ("integer", "number") and isinstance(value, bool))
    ):
        return [f"{where}: not a {kind}"]
    errors = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{where}.{key}: missing" for key in schema.get("required", []) if key not in value]
        if schema.get("additionalProperties", True) is False:
            errors += [f"{where}.{key}: not allowed" for key in value if key not in properties]
        for key, item in value.items():
            if key in properties:
                errors += _schema_errors(item, properties[key], f"{where}.{key}")
    return errors


def test_envelope_examples_satisfy_the_schema() -> None:
    """Every ``json`` block of the docs that holds an envelope (an object with an ``event_id``)."""
    schema = json.loads((REFERENCE / "envelope.schema.json").read_text())
    examples = [
        (page, block)
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for block in _json_blocks(page)
        if isinstance(json.loads(block), dict) and "event_id" in json.loads(block)
    ]
    assert any(page.name == "envelope.md" for page, _ in examples), "docs/reference/envelope.md shows no example"
    for page, example in examples:
        assert _schema_errors(json.loads(example), schema) == [], page
        parse_envelope(example)  # the model the schema comes from takes it too


def test_schema_check_rejects_an_envelope_without_a_required_field() -> None:
    """The hand-rolled check above does find a wrong envelope (else its silence proves nothing)."""
    schema = json.loads((REFERENCE / "envelope.schema.json").read_text())
    errors = _schema_errors({"event_id": "e-1", "event_type": "RoomCreated", "room_version": "7"}, schema)
    assert errors == [
        "envelope.room_id: missing",
        f"envelope.room_version: matches none of {schema['properties']['room_version']['anyOf']}",
    ]


@pytest.mark.timeout(300)
def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr


def _code_map_names() -> list[str]:
    """The paths the README's code map names: each line's first column (``cli/``, ``sink.py
    handler.py …``) and any ``name.py`` or ``folder/`` in its descriptions."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```text\n(.*?)```", readme.split("## Code map", 1)[1], flags=re.DOTALL)
    assert block is not None, "the README's code map has no text block"
    return re.findall(r"(?<![\w./-])(\w[\w/]*(?:\.py|/))(?![\w])", block.group(1))


def test_readme_code_map_names_existing_modules() -> None:
    names = _code_map_names()
    assert "app.py" in names and "plugins/" in names
    # A name is a path from the package (core/), from the repository root, or under a folder
    # of the package (``main.py`` in the ``cli/`` entry) or of plugins/ (``tencent_im/fake/``).
    known = {path.relative_to(ROOT / "core").as_posix() for path in (ROOT / "core").rglob("*")}
    known |= {path.name for path in (ROOT / "core").rglob("*")}
    known |= {path.relative_to(ROOT / "plugins").as_posix() for path in (ROOT / "plugins").rglob("*")}
    missing = [name for name in names if name.rstrip("/") not in known and not (ROOT / name).exists()]
    assert missing == []


def _section(page: str, heading: str) -> str:
    """The hand-written text under ``## heading``, up to the next heading of its level."""
    text = page.split("<!-- Everything below is generated", 1)[0]
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize(
    ("heading", "sink", "model"),
    [
        ("Kafka sink", "kafka", "room_outbox.plugins.kafka:KafkaSettings"),
        ("Tencent IM sink", "tencent_im", "room_outbox.plugins.tencent_im.settings:TencentIMSettings"),
    ],
)
def test_every_key_of_a_sink_is_in_its_table(heading: str, sink: str, model: str) -> None:
    """The sinks' own keys are documented by hand (their models are the plugins'): one was
    left out (sinks.kafka.client_id). The keys every sink shares have a section of their own."""
    import importlib

    from room_outbox.sink import SinkSettings

    module, name = model.split(":")
    settings = getattr(importlib.import_module(module), name)
    table = _section((REFERENCE / "configuration.md").read_text(), heading)
    missing = [
        key
        for key in settings.model_fields
        if key not in SinkSettings.model_fields and not re.search(rf"`(sinks\.{sink}\.)?{key}(\.[^`]*)?`", table)
    ]
    assert missing == []


def test_every_instrument_is_in_the_metrics_table() -> None:
    """The table operators read (labels, meaning) is written by hand above the generated list:
    an instrument was left out of it (room_outbox_round_failures_total)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    page = (REFERENCE / "metrics.md").read_text().split(docs_reference.MARKER, 1)[0]
    shown = set(re.findall(r"^\| `([a-z_*]+)` \|", page, re.MULTILINE))
    missing = [
        exposed
        for name, unit, kind, _, _ in docs_reference._instruments()
        if (exposed := docs_reference._prometheus_name(name, unit, kind)) not in shown
        and not any(pattern.endswith("*") and exposed.startswith(pattern[:-1]) for pattern in shown)
    ]
    assert missing == []


def test_the_lanes_sample_is_what_the_command_prints() -> None:
    """manage-lanes.md shows `room-outbox lanes`'s table: the same rows printed now match it."""
    day = 86_400_000
    rows = [
        LaneRow("main", "enabled", True, None, 0, 0, 0, None),
        LaneRow("kafka", "enabled", True, 4711, 3, 0, 1, 2_000, 0),
        LaneRow("audit_table", "disabled: holds back retention until retired", False, 1200, 0, 3511, 0, 3 * day, 1),
    ]
    page = (ROOT / "docs" / "how-to" / "manage-lanes.md").read_text()
    (sample,) = re.findall(r"^```text\n(lane .*?)^```", page, flags=re.MULTILINE | re.DOTALL)
    assert sample.rstrip("\n") == format_lanes(rows)
