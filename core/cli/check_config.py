"""``room-outbox check-config``: the whole configuration checked as ``run`` would, offline."""

from __future__ import annotations

import argparse
import json
from typing import Any

from room_outbox.cli.command import Command, add_json_option
from room_outbox.config import InvalidSettings, Settings
from room_outbox.errors import ConfigurationError
from room_outbox.observability.redaction import Redactor, redactor_for
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import CheckedConfiguration, check_configuration

#: The headings of a configuration error that lists its problems a line each.
_HEADINGS = ("invalid configuration:", "invalid environment:")


def check_config(settings: Settings, source: str | None, as_json: bool = False, command: str = "run") -> int:
    """OK with what runs, or every problem, naming the key (exit 2). ``command``: checked for
    ``run`` or for ``consume``."""
    try:
        checked = check_configuration(settings, make_plugin_manager(settings.plugins.disabled), command)
    except ConfigurationError as exc:
        return _invalid(problems(exc), source, as_json, list(settings.deprecated_names))
    if as_json:
        print(json.dumps(_report(source, checked, checked.warnings, []), indent=2))
        return 0
    runs = (
        f"consumers: {', '.join(checked.consumers)}"
        if command == "consume"
        else f"main lane sinks: {', '.join(checked.main_sinks) or 'none'};"
        f" lanes of their own: {', '.join(checked.own_lanes) or 'none'}"
    )
    print(
        f"configuration OK ({source or 'defaults and environment'}) for {command}: database {checked.database!r}; {runs}"
    )
    for line in checked.warnings:
        print(f"warning: {line}")
    return 0


def check_unloadable(
    exc: ConfigurationError, source: str | None, redactor: Redactor, as_json: bool = False, command: str = "run"
) -> int:
    """A configuration that does not load: its problems, and those of the rest of it (the
    keys in error left out), so that one run lists every error, not one a run. Raises the
    :class:`ConfigurationError` that lists them all (exit 2)."""
    found = problems(exc)
    rest = exc.rest if isinstance(exc, InvalidSettings) else None
    warnings: list[str] = []
    if rest is not None:
        redactor.add_all(redactor_for(rest))  # the error printed is masked as a loaded one's
        warnings = list(rest.deprecated_names)
        try:
            check_configuration(rest, make_plugin_manager(rest.plugins.disabled), command)
        except ConfigurationError as more:
            found += [line for line in problems(more) if line not in found]
    return _invalid([redactor.redact(line) for line in found], source, as_json, warnings)


def problems(exc: ConfigurationError) -> list[str]:
    """The problems of a configuration error, a line each, without its heading."""
    text = str(exc)
    for heading in _HEADINGS:
        if text.startswith(heading):
            return [line.strip() for line in text.removeprefix(heading).splitlines() if line.strip()]
    return [text]


def _invalid(found: list[str], source: str | None, as_json: bool, warnings: list[str]) -> int:
    """``--json``: the report with ``ok`` false and the problems; the problems as the one
    error on stderr either way (exit 2)."""
    if as_json:
        print(json.dumps(_report(source, None, warnings, found), indent=2))
    raise ConfigurationError("invalid configuration:\n  " + "\n  ".join(found))


def _report(
    source: str | None, checked: CheckedConfiguration | None, warnings: list[str], errors: list[str]
) -> dict[str, Any]:
    return {
        "ok": not errors,
        "source": source,
        "database": checked.database if checked else None,
        "main_sinks": list(checked.main_sinks) if checked else [],
        "own_lanes": list(checked.own_lanes) if checked else [],
        "consumers": list(checked.consumers) if checked else [],
        "warnings": warnings,
        "errors": errors,
    }


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_json_option(parser)
    parser.add_argument(
        "--for",
        dest="checked_for",
        choices=("run", "consume"),
        default="run",
        help="check what this command needs: consume configures no sink (default: run)",
    )


def _run(settings: Settings, args: argparse.Namespace, _redactor: Redactor) -> int:
    return check_config(settings, args.config, args.json, args.checked_for)


COMMAND = Command(
    description="Validate the configuration file and environment as `run` would, sink sections, routes and\n"
    "OTEL_* exporters included, without connecting to anything (or, with --for consume, as\n"
    "`consume` would: its consumers, no sinks). Prints OK or every problem.",
    examples="room-outbox check-config --config config/config.yaml\n"
    "room-outbox check-config --json | jq .main_sinks\n"
    "ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY=... room-outbox check-config\n"
    "room-outbox check-config --for consume --config config/config.consume.docker.yaml",
    needs="config",
    arguments=_arguments,
    run=_run,
    invalid_config=lambda exc, args, redactor: check_unloadable(
        exc, args.config, redactor, args.json, args.checked_for
    ),
)
