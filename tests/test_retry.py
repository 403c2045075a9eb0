"""Retry strategies and parking: delays, caps, jitter, max_attempts, permanent errors."""

from __future__ import annotations

import pytest

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.config import OutboxWorkerSettings, Settings, describe_validation_error


def test_fixed_interval_retries_after_the_poll_interval_forever() -> None:
    policy = RetryPolicy.from_settings(OutboxWorkerSettings(poll_interval="2s"))
    assert [policy.delay(n) for n in (1, 2, 50)] == [2.0, 2.0, 2.0]
    assert not policy.parks(10_000, permanent=True)  # V1: nothing is ever given up on


def test_linear_is_base_times_attempts_capped() -> None:
    policy = RetryPolicy(strategy="linear", base=1.5, cap=5.0, jitter=0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [1.5, 3.0, 4.5, 5.0]


def test_exponential_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(strategy="exponential", base=1.0, factor=2.0, cap=60.0, jitter=0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 6, 7, 1000)] == [1.0, 2.0, 4.0, 8.0, 32.0, 60.0, 60.0]


def test_jitter_spreads_delays_within_bounds() -> None:
    policy = RetryPolicy(strategy="exponential", base=10.0, factor=1.0, cap=100.0, jitter=0.2)
    delays = {policy.delay(3) for _ in range(200)}
    assert all(8.0 <= d <= 12.0 for d in delays)
    assert len(delays) > 100  # spread, not lockstep


def test_parking_takes_permanent_errors_and_the_last_attempt() -> None:
    policy = RetryPolicy(parking=True, max_attempts=3)
    assert policy.parks(1, permanent=True)
    assert not policy.parks(2, permanent=False)
    assert policy.parks(3, permanent=False)
    assert not RetryPolicy(parking=True).parks(10_000, permanent=False)  # no max: only permanent errors park


def test_retry_settings_are_validated_at_start_up() -> None:
    with pytest.raises(Exception) as info:
        Settings(outbox_worker={"retry": {"max_attempts": 5}})
    assert "retry.max_attempts needs parking: true" in describe_validation_error(info.value)  # type: ignore[arg-type]
    for bad, key in [
        ({"retry": {"factor": 0.5}}, "outbox_worker.retry.factor"),
        ({"retry": {"jitter": 2}}, "outbox_worker.retry.jitter"),
        ({"retry": {"base": "0s"}}, "outbox_worker.retry.base"),
        ({"ordering": "per_user"}, "outbox_worker.ordering"),
    ]:
        with pytest.raises(Exception) as info:
            Settings(outbox_worker=bad)
        assert key in describe_validation_error(info.value), bad  # type: ignore[arg-type]
    assert Settings(outbox_worker={"retry_strategy": "exponential", "parking": True}).outbox_worker.parking
