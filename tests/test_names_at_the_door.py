"""Names the databases must hold: ``node_id``, ``database.table``, lane and consumer names are
refused by ``check-config`` (and so by ``run``) with one line naming the key, instead of
passing and failing later against a column's length or PostgreSQL's 63-byte identifiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from room_outbox import SinkSpec, hookimpl
from room_outbox.cli.main import main
from room_outbox.cluster.identity import MAX_NODE_ID_LENGTH as MAX_NODE_ID
from room_outbox.config import MAX_TABLE_NAME, Settings, default_node_id
from room_outbox.errors import ConfigurationError
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import check_configuration
from room_outbox.store.factory import open_store
from room_outbox.store.schema.profiles import profile_named

BASE = {"mysql": {"dsn": "mysql://root:pw@127.0.0.1:9/x"}, "sinks": {"tencent_im": {"enabled": False}}}


def check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], **sections: object) -> tuple[int, list[str]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**BASE, **sections}))
    capsys.readouterr()
    code = main(["--config", str(path), "check-config"])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("sections", "key", "message"),
    [
        ({"node_id": "n" * (MAX_NODE_ID + 1)}, "node_id", f"{MAX_NODE_ID + 1} characters; at most {MAX_NODE_ID}"),
        ({"node_id": "node\x1b[2J"}, "node_id", "control or invisible characters"),
        (
            {"mysql": {**BASE["mysql"], "table": "t" * (MAX_TABLE_NAME + 1)}},
            "mysql.table",
            "must fit PostgreSQL's 63-byte identifiers",
        ),
        (
            {"consumers": {"c" * 64: {"handlers": ["audit"]}}},
            "consumers." + "c" * 64,
            "a consumer's name is 1 to 63 printable characters",
        ),
        (
            # Each fits alone; the lock owner <node_id>~<token>#<consumer> would not fit 128.
            {"node_id": "n" * 100, "consumers": {"c" * 19: {"handlers": ["audit"]}}},
            "consumers." + "c" * 19,
            "its lock owner <node_id>~<token>#<consumer> would be 129 characters, at most 128",
        ),
    ],
)
def test_check_config_refuses_a_name_too_long_for_the_databases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sections: dict[str, object], key: str, message: str
) -> None:
    code, err = check_config(tmp_path, capsys, **sections)
    assert code == 2
    (line,) = [line for line in err if line.strip().startswith(f"{key}:") or line.startswith(f"room-outbox: {key}:")]
    assert message in line and "\n" not in line


def test_names_at_their_limits_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = check_config(
        tmp_path,
        capsys,
        node_id="n" * MAX_NODE_ID,
        mysql={**BASE["mysql"], "table": "t" * MAX_TABLE_NAME},
        consumers={"c" * 18: {"handlers": ["audit"]}},
    )
    assert (code, err) == (0, [])


def test_the_default_node_id_fits_whatever_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "h" * 253)
    assert len(default_node_id()) <= MAX_NODE_ID
    assert Settings().node_id.startswith("hhh")


def own_lane_plugin(name: str) -> object:
    class Plugin:
        @hookimpl
        def room_outbox_register_sinks(self) -> list[SinkSpec]:
            return [SinkSpec(name, lambda _s, _c: None, enabled_by_default=True, own_lane=True)]

    return Plugin()


def test_a_lane_name_too_long_for_its_index_names_is_refused() -> None:
    too_long, longest = "l" * 37, "l" * 36
    settings = Settings(**BASE)
    with pytest.raises(ConfigurationError) as info:
        check_configuration(settings, make_plugin_manager(extra_plugins=[own_lane_plugin(too_long)]))
    (line,) = str(info.value).splitlines()[1:]
    assert line.strip().startswith(f"sinks.{too_long}: lane name") and "at most 36" in line
    checked = check_configuration(settings, make_plugin_manager(extra_plugins=[own_lane_plugin(longest)]))
    assert checked.own_lanes == [longest]


@pytest.mark.anyio
@pytest.mark.parametrize("profile", ["v1", "room_cell", "silk"])
async def test_the_longest_table_name_migrates_on_postgresql_with_every_index_name_whole(
    postgresql_dsn: str, profile: str
) -> None:
    table = "t" * MAX_TABLE_NAME
    store = await open_store(postgresql_dsn, profile=profile_named(profile, table))
    try:
        await store.migrate()
        async with store.transaction() as cur:
            await cur.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", (table,))
            indexes = sorted(row[0] for row in await cur.fetchall())
    finally:
        await store.aclose()
    assert all(name.startswith(("idx_" + table, "uk_" + table)) or name.endswith("_pkey") for name in indexes), indexes
    assert any(name.startswith("idx_") for name in indexes)
