"""Plugins: the manager factory, entry points, blocking, routing and sink configuration."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path
from typing import Any, cast

import pytest

from room_outbox import EventEnvelope, SinkContext, SinkSettings, SinkSpec, hookimpl, hookspecs
from room_outbox.config import ConfigError, Settings
from room_outbox.delivery.routing import build_router, registered_sinks
from room_outbox.envelope import KNOWN_EVENT_TYPES
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager

pytestmark = pytest.mark.anyio


class CountingSettings(SinkSettings):
    label: str = "counting"


class CountingSink:
    def __init__(self, settings: CountingSettings) -> None:
        self.settings = settings
        self.count = 0

    async def deliver(self, envelope: EventEnvelope) -> None:
        self.count += 1

    async def aclose(self) -> None:
        pass


def counting_plugin_module() -> types.ModuleType:
    module = types.ModuleType("room_outbox_counting_plugin")

    @hookimpl
    def room_outbox_register_sinks() -> list[SinkSpec[CountingSettings]]:
        def create(settings: CountingSettings, context: SinkContext) -> CountingSink:
            return CountingSink(settings)

        return [SinkSpec("counting", create, settings_model=CountingSettings)]

    module.room_outbox_register_sinks = room_outbox_register_sinks  # type: ignore[attr-defined]
    return module


class FakeDistribution(importlib.metadata.Distribution):
    """A distribution that exists only in memory, publishing one entry point."""

    def __init__(self, name: str, entry_points: str) -> None:
        self._files = {"METADATA": f"Name: {name}\nVersion: 1.0\n", "entry_points.txt": entry_points}

    def read_text(self, filename: str) -> str | None:
        return self._files.get(filename)

    def locate_file(self, path: Any) -> Path:
        return Path(str(path))


@pytest.fixture
def third_party_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the counting sink as a third-party package would: through an entry point."""
    monkeypatch.setitem(sys.modules, "room_outbox_counting_plugin", counting_plugin_module())
    real = importlib.metadata.distributions
    fake = FakeDistribution("room-outbox-counting", "[room_outbox.plugins]\ncounting = room_outbox_counting_plugin\n")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [*real(**kw), fake])


def settings(**data: Any) -> Settings:
    return Settings(**data)


async def test_builtins_register_under_fixed_names() -> None:
    pm = make_plugin_manager()
    assert pm.has_plugin("noop")
    router = await build_router(pm, settings(sinks={"tencent_im": {"enabled": False}}), Redactor())
    assert router.routes == {"RoomCreated": "noop", "RoomHeatChanged": "noop", "RoomRankChanged": "noop"}


async def test_a_third_party_sink_is_found_through_its_entry_point(third_party_installed: None) -> None:
    pm = make_plugin_manager()
    assert pm.has_plugin("counting")
    cfg = settings(
        sinks={"tencent_im": {"enabled": False}, "counting": {"event_types": ["RoomGiftSent"], "label": "x"}}
    )
    router = await build_router(pm, cfg, Redactor())
    name, sink = router.sink_for("RoomGiftSent") or ("", None)
    assert name == "counting" and isinstance(sink, CountingSink) and sink.settings.label == "x"
    await sink.deliver(EventEnvelope(event_id="e", event_type="RoomGiftSent", room_id="r"))
    assert sink.count == 1


async def test_a_third_party_sink_is_opt_in(third_party_installed: None) -> None:
    router = await build_router(make_plugin_manager(), settings(sinks={"tencent_im": {"enabled": False}}), Redactor())
    assert "counting" not in router.sinks


async def test_disabled_plugins_are_never_loaded(third_party_installed: None) -> None:
    pm = make_plugin_manager(disabled=["counting", "noop"])
    assert not pm.has_plugin("counting") and not pm.has_plugin("noop")


async def test_a_sink_enabled_in_config_but_blocked_stops_start_up(third_party_installed: None) -> None:
    pm = make_plugin_manager(disabled=["counting"])
    with pytest.raises(
        ConfigError, match=r"sinks\.counting: is enabled, but plugin 'counting' is listed in plugins\.disabled"
    ):
        await build_router(pm, settings(sinks={"counting": {"event_types": ["RoomGiftSent"]}}), Redactor())


async def test_an_unknown_sink_in_config_stops_start_up() -> None:
    with pytest.raises(ConfigError, match=r"sinks\.kafak: no installed plugin provides a sink named 'kafak'"):
        await build_router(make_plugin_manager(), settings(sinks={"kafak": {"enabled": True}}), Redactor())


async def test_an_unknown_sink_that_is_disabled_is_fine() -> None:
    router = await build_router(
        make_plugin_manager(),
        settings(sinks={"kafak": {"enabled": False}, "tencent_im": {"enabled": False}}),
        Redactor(),
    )
    assert "kafak" not in router.sinks


async def test_bad_sink_settings_name_the_key(third_party_installed: None) -> None:
    with pytest.raises(ConfigError) as info:
        await build_router(
            make_plugin_manager(),
            settings(sinks={"counting": {"event_types": ["RoomGiftSent"], "lable": "x"}}),
            Redactor(),
        )
    assert "sinks.counting.lable" in str(info.value)


@pytest.mark.parametrize("entry", ["*", "Room*", "", " RoomCreated", "RoomCreated,RoomHeatChanged"])
async def test_an_event_types_entry_that_is_not_a_name_is_refused_naming_the_key(entry: str) -> None:
    """A pattern or a blank would match no row's type: the types it was meant for would be
    parked with no_route, so the configuration is refused instead, saying how to take them all."""
    with pytest.raises(ConfigError) as info:
        await build_router(
            make_plugin_manager(),
            settings(sinks={"tencent_im": {"enabled": False}, "noop": {"event_types": [entry]}}),
            Redactor(),
        )
    message = str(info.value)
    assert "sinks.noop.event_types" in message and f"{entry!r} is not an event type's name" in message
    assert "leaves event_types out" in message


async def test_an_event_type_goes_to_exactly_one_sink(third_party_installed: None) -> None:
    cfg = settings(sinks={"tencent_im": {"enabled": False}, "counting": {"event_types": ["RoomCreated"]}})
    with pytest.raises(ConfigError, match="RoomCreated is already taken by sink"):
        await build_router(make_plugin_manager(), cfg, Redactor())


async def test_one_sink_may_take_the_remaining_types(third_party_installed: None) -> None:
    cfg = settings(sinks={"tencent_im": {"enabled": False}, "counting": {"event_types": None}})
    router = await build_router(make_plugin_manager(), cfg, Redactor())
    noop_types = {"RoomCreated", "RoomHeatChanged", "RoomRankChanged"}
    assert {t for t, s in router.routes.items() if s == "counting"} == KNOWN_EVENT_TYPES - noop_types
    route = router.sink_for("RoomNobodyKnows")  # routing.main_default: all, as V1 sends every type
    assert route is not None and route[0] == "counting"
    assert router.sink_for("RoomCreated") is not None and router.sink_for("RoomCreated")[0] == "noop"  # type: ignore[index]
    known_only = await build_router(
        make_plugin_manager(), settings(sinks=cfg.sinks, routing={"main_default": "known"}), Redactor()
    )
    assert known_only.sink_for("RoomNobodyKnows") is None  # parked with no_route instead
    assert known_only.sink_for("RoomGiftSent") is not None


async def test_a_plugin_that_fails_to_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distributions
    broken = FakeDistribution("room-outbox-broken", "[room_outbox.plugins]\nbroken = room_outbox_no_such_module\n")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [*real(**kw), broken])
    with pytest.raises(ConfigError, match=r"plugin 'broken' \(distribution 'room-outbox-broken'.*failed to load"):
        make_plugin_manager()
    assert make_plugin_manager(disabled=["broken"])  # blocking it is the way out


def installed(monkeypatch: pytest.MonkeyPatch, *distributions: FakeDistribution, first: bool = False) -> None:
    """``distributions`` installed besides the real ones, listed after them or (``first``) before."""
    real = importlib.metadata.distributions
    if first:
        monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [*distributions, *real(**kw)])
    else:
        monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [*real(**kw), *distributions])


@pytest.mark.parametrize("first", [True, False], ids=["listed-first", "listed-last"])
def test_an_entry_point_named_like_a_built_in_is_refused(monkeypatch: pytest.MonkeyPatch, first: bool) -> None:
    """It would replace the built-in without a word (which one loads depends on the order
    distributions are listed in)."""
    monkeypatch.setitem(sys.modules, "room_outbox_counting_plugin", counting_plugin_module())
    installed(
        monkeypatch,
        FakeDistribution("aaa-shadow", "[room_outbox.plugins]\nnoop = room_outbox_counting_plugin\n"),
        first=first,
    )
    with pytest.raises(ConfigError, match=r"plugin 'noop' .*'aaa-shadow'.*plugins.disabled"):
        make_plugin_manager()
    assert not make_plugin_manager(disabled=["noop"]).has_plugin("noop")  # the way out


def test_a_name_two_distributions_publish_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "room_outbox_counting_plugin", counting_plugin_module())
    entry = "[room_outbox.plugins]\ncounting = room_outbox_counting_plugin\n"
    installed(monkeypatch, FakeDistribution("counting-a", entry), FakeDistribution("counting-b", entry))
    with pytest.raises(
        ConfigError, match=r"'counting' is published by two distributions, 'counting-a' and 'counting-b'"
    ):
        make_plugin_manager()
    assert not make_plugin_manager(disabled=["counting"]).has_plugin("counting")


def test_one_module_under_two_entry_point_names_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "room_outbox_counting_plugin", counting_plugin_module())
    both = "[room_outbox.plugins]\ncounting = room_outbox_counting_plugin\ncounting2 = room_outbox_counting_plugin\n"
    installed(monkeypatch, FakeDistribution("room-outbox-counting", both))
    with pytest.raises(ConfigError, match=r"plugin 'counting2' .* is the module of plugin 'counting' already"):
        make_plugin_manager()
    assert make_plugin_manager(disabled=["counting2"]).has_plugin("counting")


@pytest.mark.parametrize("statement", ["raise SystemExit(7)", "raise KeyboardInterrupt"])
def test_a_plugin_exiting_at_import_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, statement: str) -> None:
    (tmp_path / "room_outbox_exiting_plugin.py").write_text(statement + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed(
        monkeypatch,
        FakeDistribution("room-outbox-exiting", "[room_outbox.plugins]\nexiting = room_outbox_exiting_plugin\n"),
    )
    with pytest.raises(
        ConfigError,
        match=r"plugin 'exiting' \(distribution 'room-outbox-exiting'.*failed to load: (SystemExit: 7|KeyboardInterrupt); .*plugins.disabled",
    ):
        make_plugin_manager()


class Unprintable(Exception):
    """A plugin's exception whose message cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("str exploded")


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (RuntimeError("boom"), "RuntimeError: boom"),
        (SystemExit(3), "SystemExit: 3"),
        (Unprintable(), "Unprintable (its message could not be read: RuntimeError: str exploded)"),
    ],
    ids=["RuntimeError", "SystemExit", "unprintable"],
)
def test_a_registration_hook_that_raises_is_named(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException, said: str
) -> None:
    module = types.ModuleType("room_outbox_raising_plugin")

    @hookimpl
    def room_outbox_register_sinks() -> list[SinkSpec[CountingSettings]]:
        raise raised

    module.room_outbox_register_sinks = room_outbox_register_sinks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "room_outbox_raising_plugin", module)
    installed(
        monkeypatch,
        FakeDistribution("room-outbox-raising", "[room_outbox.plugins]\nraising = room_outbox_raising_plugin\n"),
    )
    with pytest.raises(
        ConfigError,
        match=r"plugin 'raising' \(distribution 'room-outbox-raising'\) failed in room_outbox_register_sinks: "
        + re.escape(said)
        + "; .*plugins.disabled",
    ):
        registered_sinks(make_plugin_manager())


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        ("wrong", "it returned a value of type str, where a list of SinkSpec is expected"),
        ([None], "item 0 of what it returned is of type NoneType, where a list of SinkSpec is expected"),
        (3, "it returned a value of type int, where a list of SinkSpec is expected"),
    ],
    ids=["str", "None item", "int"],
)
def test_a_registration_hook_returning_the_wrong_type_is_named(
    monkeypatch: pytest.MonkeyPatch, returned: object, said: str
) -> None:
    """Checked where it is called: a one-line error naming the plugin and its distribution
    (exit 2, as for a hook that raises), never a traceback from deep inside start-up."""
    module = types.ModuleType("room_outbox_wrong_plugin")

    @hookimpl
    def room_outbox_register_sinks() -> list[SinkSpec[CountingSettings]]:
        return cast("list[SinkSpec[CountingSettings]]", returned)

    module.room_outbox_register_sinks = room_outbox_register_sinks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "room_outbox_wrong_plugin", module)
    installed(
        monkeypatch, FakeDistribution("room-outbox-wrong", "[room_outbox.plugins]\nwrong = room_outbox_wrong_plugin\n")
    )
    with pytest.raises(ConfigError) as raised:
        registered_sinks(make_plugin_manager())
    assert str(raised.value) == (
        "plugin 'wrong' (distribution 'room-outbox-wrong') failed in room_outbox_register_sinks: TypeError: "
        f"{said}; fix it or add 'wrong' to plugins.disabled"
    )
    assert raised.value.exit_code == 2


def test_two_plugins_registering_one_sink_name_are_both_named(third_party_installed: None) -> None:
    class Another:
        @hookimpl
        def room_outbox_register_sinks(self) -> list[SinkSpec[CountingSettings]]:
            return [SinkSpec("counting", CountingSink, settings_model=CountingSettings)]

    pm = make_plugin_manager(extra_plugins=[Another()])
    another = pm.get_name(next(p for p in pm.get_plugins() if isinstance(p, Another)))
    with pytest.raises(ConfigError, match="two plugins register a sink named 'counting'") as refused:
        registered_sinks(pm)
    assert "plugin 'counting' (distribution 'room-outbox-counting')" in str(refused.value)
    assert f"plugin '{another}'" in str(refused.value)


async def test_a_misspelt_hook_is_caught() -> None:
    class Misspelt:
        @hookimpl
        def room_outbox_register_sink(self) -> list[SinkSpec[SinkSettings]]:  # missing "s"
            return []

    with pytest.raises(ConfigError, match="room_outbox_register_sink"):
        make_plugin_manager(extra_plugins=[Misspelt()])


async def test_a_sink_factory_error_is_named_and_redacted() -> None:
    class Exploding:
        @hookimpl
        def room_outbox_register_sinks(self) -> list[SinkSpec[SinkSettings]]:
            def create(settings: SinkSettings, context: SinkContext) -> Any:
                context.add_secret("s3cr3t-value")
                raise RuntimeError("cannot reach s3cr3t-value")

            return [SinkSpec("exploding", create, enabled_by_default=True)]

    redactor = Redactor()
    with pytest.raises(ConfigError) as info:
        await build_router(
            make_plugin_manager(extra_plugins=[Exploding()]),
            settings(sinks={"tencent_im": {"enabled": False}}),
            redactor,
        )
    assert "sinks.exploding: could not be created" in str(info.value)
    assert "s3cr3t-value" not in str(info.value)


ROOT = Path(__file__).parent.parent


def _signature(function: ast.FunctionDef) -> tuple[list[str], str]:
    """Parameter names (``self`` left out) and the return annotation, a plugin type's own
    type argument left out (``SinkSpec[KafkaSettings]`` is the spec's ``SinkSpec[Any]``)."""

    class Unparameterise(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            if isinstance(node.value, ast.Name) and node.value.id.endswith("Spec"):
                return node.value
            return self.generic_visit(node)

    params = [a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)]
    returns = Unparameterise().visit(function.returns) if function.returns is not None else None
    return [p for p in params if p != "self"], ast.unparse(returns) if returns is not None else ""


def _implementations(name: str, sources: dict[str, str]) -> dict[str, tuple[list[str], str]]:
    found = {}
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                found[f"{where}:{node.lineno}"] = _signature(node)
    return found


def test_every_hook_is_documented_tested_and_implemented_as_specified() -> None:
    """Meta-test (after datasette): each hookspec has a docstring, an entry in the docs site and
    a test implementing it; every implementation in the tests, the docs' examples, the built-in
    plugins and the example plugins takes only the spec's arguments and returns its type."""
    readme = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    readme_code = "\n".join(re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL))
    tests = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    shipped = {
        str(p.relative_to(ROOT)): p.read_text() for d in ("plugins", "examples") for p in (ROOT / d).rglob("*.py")
    }
    hooks = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("room_outbox_")]
    assert hooks
    for name in hooks:
        spec = getattr(hookspecs, name)
        assert inspect.getdoc(spec), f"{name} has no docstring"
        assert name in readme, f"{name} is not documented in docs/"
        spec_node = next(iter(_implementations(name, {"hookspecs": inspect.getsource(hookspecs)}).values()))
        assert list(inspect.signature(spec).parameters) == spec_node[0]
        in_tests = _implementations(name, tests)
        assert in_tests, f"{name} has no test implementing it"
        for where, (params, returns) in {
            **in_tests,
            **_implementations(name, {"docs": readme_code, **shipped}),
        }.items():
            assert set(params) <= set(spec_node[0]), f"{where}: {name} takes {params}, the spec only {spec_node[0]}"
            assert returns == spec_node[1], f"{where}: {name} returns {returns}, the spec {spec_node[1]}"


async def test_plugin_migrations_run_on_migrate(store: Any) -> None:
    """`room_outbox_migrations`: a plugin's idempotent DDL runs on every `room-outbox migrate`
    (this one registers no sink or handler, so nothing it registers can be disabled)."""
    from room_outbox.delivery.lanes import migrate_plugins

    class WithTable:
        @hookimpl
        def room_outbox_migrations(self) -> list[str]:
            return ["CREATE TABLE IF NOT EXISTS plugin_owned (id INT PRIMARY KEY)"]

    plugin = WithTable()
    pm = make_plugin_manager(extra_plugins=[plugin])
    cfg = settings(sinks={"tencent_im": {"enabled": False}})
    for _ in range(2):  # idempotent: the statements run every time without harm
        changes = await migrate_plugins(store, pm, cfg)
        assert changes[-1] == f"ran 1 schema statement(s) for plugin {pm.get_name(plugin)}"
    async with store.transaction() as cur:
        await cur.execute("SHOW TABLES LIKE 'plugin_owned'")
        assert await cur.fetchone()


def test_a_plugins_statements_are_used_while_a_sink_or_handler_it_registers_is_enabled() -> None:
    """`room_outbox_migrations` statements belong to the plugin's sinks and handlers: unused
    while none of them is enabled, named after the enabled ones when used."""
    from room_outbox import HandlerSettings, HandlerSpec
    from room_outbox.store.schema.plugins import used_plugin_statements

    class SinkWithTable:
        @hookimpl
        def room_outbox_register_sinks(self) -> list[SinkSpec[SinkSettings]]:
            return [SinkSpec("archive", lambda settings, context: None)]  # never built here

        @hookimpl
        def room_outbox_migrations(self) -> list[str]:
            return ["CREATE TABLE IF NOT EXISTS archive (id INT PRIMARY KEY)"]

    class HandlerWithTable:
        @hookimpl
        def room_outbox_register_handlers(self) -> list[HandlerSpec[HandlerSettings]]:
            return [HandlerSpec("tally", lambda settings, context: None)]  # never built here

        @hookimpl
        def room_outbox_migrations(self) -> list[str]:
            return ["CREATE TABLE IF NOT EXISTS tally (id INT PRIMARY KEY)", "CREATE INDEX i ON tally (id)"]

    pm = make_plugin_manager(extra_plugins=[SinkWithTable(), HandlerWithTable()])
    used = {u.owner: u.statements for u in used_plugin_statements(pm, sinks={"tencent_im"}, handlers={"audit"})}
    assert not {"sink archive", "handler tally"} & set(used)  # installed, not enabled
    used = {u.owner: u.statements for u in used_plugin_statements(pm, sinks={"archive"}, handlers={"tally"})}
    assert len(used["sink archive"]) == 1 and len(used["handler tally"]) == 2


class _SinkWithMigrations:
    """A plugin with a sink of its own (``archive``) and a ``room_outbox_migrations`` hook
    answering ``answer`` (raised when an exception)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.asked = 0

    @hookimpl
    def room_outbox_register_sinks(self) -> list[SinkSpec[SinkSettings]]:
        return [SinkSpec("archive", lambda settings, context: None)]  # never built here

    @hookimpl
    def room_outbox_migrations(self) -> list[str]:
        self.asked += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return cast("list[str]", self.answer)


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (RuntimeError("migrations hook raised"), "RuntimeError: migrations hook raised"),
        (
            "CREATE TABLE IF NOT EXISTS archive (id INT)",
            "TypeError: it returned a value of type str, where a list of str is expected",
        ),
        ([None], "TypeError: item 0 of what it returned is of type NoneType, where a list of str is expected"),
    ],
    ids=["raises", "str", "None item"],
)
def test_a_migrations_hook_is_called_only_for_a_plugin_in_use_and_its_errors_named(answer: object, said: str) -> None:
    """An installed plugin whose sinks are all disabled is not asked for its statements at
    all; asked, a hook that raises or returns anything but a list of str stops migrate with a
    one-line error naming the plugin (a str is never run character by character)."""
    from room_outbox.store.schema.plugins import used_plugin_statements

    plugin = _SinkWithMigrations(answer)
    pm = make_plugin_manager(extra_plugins=[plugin])
    name = pm.get_name(plugin)
    assert used_plugin_statements(pm, sinks={"tencent_im"}, handlers=set()) == []
    assert plugin.asked == 0
    with pytest.raises(ConfigError) as raised:
        used_plugin_statements(pm, sinks={"archive"}, handlers=set())
    assert str(raised.value) == (
        f"plugin {name!r} failed in room_outbox_migrations: {said}; fix it or add {name!r} to plugins.disabled"
    )


async def test_a_plugin_statement_the_server_refuses_names_the_plugin(store: Any) -> None:
    """Bad SQL from a plugin stops migrate with an error naming the plugin and the step,
    not a bare driver error."""
    from room_outbox.delivery.lanes import migrate_plugins

    plugin = _SinkWithMigrations(["CREATE TABLE archive (a int"])
    pm = make_plugin_manager(extra_plugins=[plugin])
    cfg = settings(sinks={"tencent_im": {"enabled": False}, "archive": {"enabled": True}})
    with pytest.raises(ConfigError) as raised:
        await migrate_plugins(store, pm, cfg)
    said = str(raised.value)
    assert said.startswith(
        f"migrate: running 1 schema statement(s) for sink archive: the server refused a statement of plugin"
        f" {pm.get_name(plugin)!r} (You have an error in your SQL syntax"
    ), said
    assert said.endswith("then run migrate again") and raised.value.exit_code == 2


async def test_migrate_on_sqlite_skips_plugin_tables_but_creates_own_lanes(tmp_path: Path) -> None:
    """Plugins' statements are MySQL's: a store without the ``plugin_schema`` capability skips
    them and says so; the lanes of their own are the store's and are created."""
    from room_outbox.delivery.lanes import migrate_plugins
    from room_outbox.store.factory import open_store

    store = await open_store(f"sqlite:///{tmp_path / 'outbox.db'}")
    try:
        await store.migrate()
        pm = make_plugin_manager()
        changes = await migrate_plugins(
            store, pm, settings(sinks={"tencent_im": {"enabled": False}, "audit_table": {}})
        )
        assert changes == [
            "created table room_outbox_lane_cursor",
            "created table room_outbox_tail_skipped",  # where the feeder records the ids it gives up on
            "created table room_outbox_lane_audit_table",
            "skipped 1 schema statement(s) for sink audit_table: they are MySQL's",
        ]
        changes = await migrate_plugins(store, pm, settings(sinks={"kafka": {"enabled": True}}))
        assert changes == [  # Kafka tails: no lane table
            "created table room_outbox_tail_parked",
        ]
        lane_table = {"kafka": {"enabled": True, "relay": "lane_table"}}
        changes = await migrate_plugins(store, pm, settings(sinks=lane_table))
        assert changes[0] == "created table room_outbox_lane_kafka"
    finally:
        await store.aclose()


SPECS = """
from room_outbox import HandlerFactoryContext, HandlerSettings, HandlerSpec, SinkContext, SinkSettings, SinkSpec
from room_outbox.plugins.audit_log import AuditHandler
from room_outbox.plugins.noop import NoopSink


class Stats(HandlerSettings):
    field: str = "amount"


class Other(HandlerSettings):
    pass


def typed(settings: Stats, context: HandlerFactoryContext) -> AuditHandler:
    return AuditHandler()


def plain(settings: HandlerSettings, context: HandlerFactoryContext) -> AuditHandler:
    return AuditHandler()


class Sized(SinkSettings):
    size: int = 1


class OtherSink(SinkSettings):
    pass


def sized(settings: Sized, context: SinkContext) -> NoopSink:
    return NoopSink()


def common(settings: SinkSettings, context: SinkContext) -> NoopSink:
    return NoopSink()


fine = [HandlerSpec("a", typed, settings_model=Stats), HandlerSpec("b", plain), HandlerSpec("c", plain, event_types=None)]
wrong_model = HandlerSpec("d", typed, settings_model=Other)
no_model = HandlerSpec("e", typed)  # its factory would get HandlerSettings
fine_sinks = [SinkSpec("f", sized, settings_model=Sized), SinkSpec("g", common, own_lane=True)]
wrong_sink_model = SinkSpec("h", sized, settings_model=OtherSink)
no_sink_model = SinkSpec("i", sized)  # its factory would get SinkSettings
former = [SinkSpec("j", Sized, sized, True), HandlerSpec("k", typed, None, settings_model=Stats)]  # deprecated
former_wrong = SinkSpec("l", OtherSink, sized)
"""


def test_a_spec_is_typed_by_its_settings_model(tmp_path: Path) -> None:
    """SinkSpec and HandlerSpec: a factory type-checks only with the settings model it receives
    (mypy on a tree shaped like the installed package, as scripts/typecheck.sh checks the core);
    the deprecated positional forms are typed the same way."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    package = tmp_path / "room_outbox"
    package.mkdir()
    for entry in (root / "core").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "plugins").symlink_to(root / "plugins")
    (tmp_path / "specs.py").write_text(SPECS)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), "--follow-imports=silent",
         "--cache-dir", str(tmp_path / ".mypy_cache"), "specs.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    source = SPECS.splitlines()
    failing = [
        source[int(line.split(":")[1]) - 1].split()[0] for line in result.stdout.splitlines() if ": error:" in line
    ]
    assert failing == ["wrong_model", "no_model", "wrong_sink_model", "no_sink_model", "former_wrong"], result.stdout


def test_the_former_positional_forms_still_work_and_warn() -> None:
    """SinkSpec(name, settings_model, factory, ...) and HandlerSpec(name, factory, event_types,
    ...) make the same spec as the keyword forms, with a warning that names the new form and
    points at the caller."""
    from room_outbox import HandlerSettings, HandlerSpec

    def create(settings: CountingSettings, context: SinkContext) -> CountingSink:
        return CountingSink(settings)

    def handle(settings: HandlerSettings, context: Any) -> Any:
        return None

    with pytest.warns(DeprecationWarning, match=r"write SinkSpec\(name, factory, settings_model=") as caught:
        sink = SinkSpec("counting", CountingSettings, create, True, own_lane=True)
    assert caught[0].filename == __file__
    assert sink == SinkSpec("counting", create, settings_model=CountingSettings, enabled_by_default=True, own_lane=True)

    types_ = frozenset({"RoomGiftSent"})
    with pytest.warns(DeprecationWarning, match=r"write HandlerSpec\(name, factory, event_types=") as caught:
        handler = HandlerSpec("tally", handle, types_, HandlerSettings, {"mysql": ["SELECT 1"]})
    assert caught[0].filename == __file__
    assert handler == HandlerSpec(
        "tally", handle, event_types=types_, settings_model=HandlerSettings, schema={"mysql": ["SELECT 1"]}
    )


def test_the_keyword_forms_do_not_warn_and_default_to_the_base_settings() -> None:
    from room_outbox import HandlerSettings, HandlerSpec

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink = SinkSpec("plain", lambda settings, context: CountingSink(CountingSettings()))
        handler = HandlerSpec("plain", lambda settings, context: None)
    assert sink.settings_model is SinkSettings and not (sink.enabled_by_default or sink.own_lane or sink.ordered_log)
    assert handler.settings_model is HandlerSettings and handler.event_types is None and handler.schema == {}


def test_a_failing_plugins_exception_is_described_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error names the exception's text once, made once (a plugin's own ``__str__`` may be
    dear, or say something else each time it is asked)."""

    class Talkative(RuntimeError):
        said = 0

        def __str__(self) -> str:
            Talkative.said += 1
            return f"told {Talkative.said} time(s)"

    module = types.ModuleType("room_outbox_talkative_plugin")

    @hookimpl
    def room_outbox_register_sinks() -> list[SinkSpec[CountingSettings]]:
        raise Talkative

    module.room_outbox_register_sinks = room_outbox_register_sinks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "room_outbox_talkative_plugin", module)
    installed(
        monkeypatch,
        FakeDistribution("room-outbox-talkative", "[room_outbox.plugins]\ntalkative = room_outbox_talkative_plugin\n"),
    )
    with pytest.raises(ConfigError) as refused:
        registered_sinks(make_plugin_manager())
    assert "failed in room_outbox_register_sinks: Talkative: told 1 time(s); " in str(refused.value)
    assert Talkative.said == 1


#: The operator's Ctrl-C while a plugin is busy: the SIGINT comes from outside (here from its
#: own process, as a terminal sends it), while the plugin waits for it.
CTRL_C_MEANWHILE = """\
os.kill(os.getpid(), signal.SIGINT)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:  # the signal ends this wait at its next tick
    time.sleep(0.01)
"""

#: A plugin the Ctrl-C catches importing, and one it catches registering its sinks.
INTERRUPTED_PLUGINS = {
    "importing": "import os, signal, time\n" + CTRL_C_MEANWHILE,
    "registering": "import os, signal, time\nfrom room_outbox import hookimpl\n\n@hookimpl\n"
    "def room_outbox_register_sinks():\n" + textwrap.indent(CTRL_C_MEANWHILE, "    ") + "    return []\n",
}


@pytest.mark.parametrize("busy", list(INTERRUPTED_PLUGINS))
def test_ctrl_c_while_a_plugin_starts_stops_the_command_as_interrupted(tmp_path: Path, busy: str) -> None:
    """A real SIGINT while a plugin imports or registers is the operator's interruption, not
    the plugin's failure: exit 130, "interrupted", the plugin not blamed. (A plugin raising
    KeyboardInterrupt itself is still named: test_a_plugin_exiting_at_import_is_named.)"""
    site = tmp_path / "site"
    (site / "room_outbox_interrupted-0.dist-info").mkdir(parents=True)
    (site / "room_outbox_interrupted-0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: room-outbox-interrupted\nVersion: 0\n"
    )
    (site / "room_outbox_interrupted-0.dist-info" / "entry_points.txt").write_text(
        "[room_outbox.plugins]\ninterrupted = room_outbox_interrupted_plugin\n"
    )
    (site / "room_outbox_interrupted_plugin.py").write_text(INTERRUPTED_PLUGINS[busy])
    config = tmp_path / "room-outbox.yaml"
    config.write_text(
        f"database:\n  dsn: 'sqlite:///{tmp_path / 'outbox.db'}'\nsinks:\n  tencent_im: {{enabled: false}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "check-config"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stderr.splitlines()[-1:]) == (130, ["room-outbox: interrupted"]), done.stderr
    assert "interrupted' (distribution" not in done.stderr
