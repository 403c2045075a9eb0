"""A failure that comes back every round is logged when it begins, once per interval while it
lasts, and once when it ends: not once a round."""

from __future__ import annotations

import logging

import pytest

from room_outbox.observability.repeated import RepeatedFailure


def test_a_failure_each_round_makes_a_line_when_it_begins_one_a_minute_and_one_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failing = RepeatedFailure(
        logging.getLogger("test.repeated"), "round failed", "rounds succeed again", 60.0, lambda: now[0], lane="main"
    )
    with caplog.at_level(logging.INFO, logger="test.repeated"):
        for second in range(150):  # a round a second for two and a half minutes
            now[0] = 100.0 + second
            failing.failed(f"error {second}")
        failing.succeeded()
        failing.succeeded()  # nothing more to say
        now[0] = 300.0
        failing.failed("again")
    lines = [(r.levelname, r.message, {k: getattr(r, k, None) for k in ("error", "failed_rounds", "lane")})
             for r in caplog.records]  # fmt: skip
    assert lines == [
        ("ERROR", "round failed", {"error": "error 0", "failed_rounds": None, "lane": "main"}),
        ("ERROR", "round failed", {"error": "error 60", "failed_rounds": 61, "lane": "main"}),
        ("ERROR", "round failed", {"error": "error 120", "failed_rounds": 121, "lane": "main"}),
        ("WARNING", "rounds succeed again", {"error": None, "failed_rounds": 150, "lane": "main"}),
        ("ERROR", "round failed", {"error": "again", "failed_rounds": None, "lane": "main"}),  # news again
    ]
    assert caplog.records[2].failing_for_s == 120.0 and caplog.records[3].failing_for_s == 149.0
