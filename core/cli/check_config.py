"""``room-outbox check-config``: the whole configuration checked as ``run`` would, offline."""

from __future__ import annotations

import argparse
import json

from room_outbox.cli.command import Command, add_json_option
from room_outbox.config import Settings
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import check_configuration


def check_config(settings: Settings, source: str | None, as_json: bool = False) -> int:
    """OK with what runs, or (raised before this returns) every problem, naming the key."""
    checked = check_configuration(settings, make_plugin_manager(settings.plugins.disabled))
    if as_json:
        doc = {
            "ok": True,
            "source": source,
            "database": checked.database,
            "main_sinks": list(checked.main_sinks),
            "own_lanes": list(checked.own_lanes),
            "warnings": list(settings.deprecated_names),
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"configuration OK ({source or 'defaults and environment'}): database {checked.database!r};"
        f" main lane sinks: {', '.join(checked.main_sinks) or 'none'};"
        f" lanes of their own: {', '.join(checked.own_lanes) or 'none'}"
    )
    for line in settings.deprecated_names:
        print(f"warning: {line}")
    return 0


def _run(settings: Settings, args: argparse.Namespace, _redactor: Redactor) -> int:
    return check_config(settings, args.config, args.json)


COMMAND = Command(
    description="Validate the configuration file and environment as `run` would, sink sections, routes and\n"
    "OTEL_* exporters included, without connecting to anything. Prints OK or every problem.",
    examples="room-outbox check-config --config config/config.yaml\n"
    "room-outbox check-config --json | jq .main_sinks\n"
    "ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY=... room-outbox check-config",
    needs="config",
    arguments=add_json_option,
    run=_run,
)
