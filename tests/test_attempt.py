"""The attempt's failure vocabulary: classification, redaction, and the cut at LAST_ERROR_MAX."""

from __future__ import annotations

import pytest

from room_outbox.attempt.failure import ErrorClass, classify, describe, error_text, failure
from room_outbox.errors import PermanentSinkError, RetryableSinkError, ThrottledSinkError
from room_outbox.observability.redaction import Redactor
from room_outbox.store.schema.columns import LAST_ERROR_MAX

SECRET = "s3cr3t-usersig-value"


def _redactor() -> Redactor:
    redactor = Redactor()
    redactor.add(SECRET)
    return redactor


@pytest.mark.parametrize(
    ("exc", "error_class", "permanent"),
    [
        (TimeoutError(), ErrorClass.TIMEOUT, False),
        (PermanentSinkError("group gone"), ErrorClass.PERMANENT, True),
        (RetryableSinkError("503"), ErrorClass.RETRYABLE, False),
        (ValueError("oops"), ErrorClass.SINK_BUG, False),
    ],
)
def test_classify_maps_each_sink_exception_to_its_error_class(
    exc: Exception, error_class: ErrorClass, permanent: bool
) -> None:
    got = classify(_redactor(), "im", exc, timeout=2.5)
    assert (got.sink, got.error_class, got.permanent, got.throttled) == ("im", error_class, permanent, False)
    assert got.error.startswith("im: ")


def test_classify_names_the_deadline_of_a_timeout() -> None:
    assert classify(_redactor(), "im", TimeoutError(), timeout=2.5).error == "im: no answer within publish_timeout 2.5s"


def test_classify_keeps_a_throttled_delivery_apart_with_its_retry_after() -> None:
    got = classify(_redactor(), "im", ThrottledSinkError("rate limit", retry_after=0.25), timeout=1)
    assert (got.error_class, got.throttled, got.permanent, got.retry_after) == (ErrorClass.THROTTLED, True, False, 0.25)


def test_error_classes_keep_their_metric_label_values() -> None:
    assert [str(c) for c in ErrorClass] == [
        "bad_envelope", "no_route", "timeout", "permanent", "retryable", "sink_bug", "throttled",
    ]  # fmt: skip
    assert {c for c in ErrorClass if c.permanent} == {
        ErrorClass.BAD_ENVELOPE,
        ErrorClass.NO_ROUTE,
        ErrorClass.PERMANENT,
    }


def test_error_text_redacts_then_cuts_at_last_error_max() -> None:
    # The secret straddles the cut: redacting after cutting would leave half of it.
    text = "x" * (LAST_ERROR_MAX - 5) + SECRET + "y" * 100
    got = error_text(_redactor(), text)
    assert len(got) == LAST_ERROR_MAX and got.endswith("…")
    assert SECRET[:5] not in got[LAST_ERROR_MAX - 10 :]


def test_error_text_keeps_a_short_text_whole_but_its_secrets() -> None:
    assert SECRET not in error_text(_redactor(), f"denied for {SECRET}")
    assert error_text(_redactor(), "short") == "short"


def test_failure_and_classify_redact_the_sink_text() -> None:
    assert SECRET not in classify(_redactor(), "im", RetryableSinkError(f"bad sig {SECRET}"), timeout=1).error
    assert SECRET not in failure(_redactor(), "-", ErrorClass.BAD_ENVELOPE, f"bad {SECRET}").error


def test_describe_names_the_exception_type() -> None:
    assert describe(KeyError()) == "KeyError"
    assert describe(ValueError("bad")) == "ValueError: bad"
