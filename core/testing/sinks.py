"""The contract every sink keeps, as one base class its tests subclass, and a harness that
runs a sink against events with no database or dispatcher.

A sink's test module defines ``class TestXSink(SinkContract)`` and a ``harness`` fixture
returning a :class:`SinkHarness`: the sink's settings against a real destination, how to see a
delivery arrive there, and how to make that destination fail. :class:`SinkContract` then
checks every sink alike. The contract runs under pytest with anyio's plugin
(``pytest.mark.anyio``).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from room_outbox.config import describe_validation_error
from room_outbox.envelope import EventEnvelope
from room_outbox.sink import (
    PermanentSinkError,
    RetryableSinkError,
    Sink,
    SinkContext,
    SinkSettings,
    SinkSpec,
    ThrottledSinkError,
)

#: The dispatcher's deadline for one delivery in these tests.
PUBLISH_TIMEOUT = 2.0
#: How long aclose may take.
CLOSE_TIMEOUT = 10.0

Outage = Callable[[], AbstractAsyncContextManager[dict[str, Any]]]


@dataclass
class SinkHarness:
    """One sink against a real destination, and the ways to make that destination fail."""

    #: ``sinks.<name>`` for a sink that works.
    section: dict[str, Any]
    #: Whether ``event`` has arrived at the destination.
    delivered: Callable[[EventEnvelope], Awaitable[bool]]
    #: Bad values of the sink's own keys: (overrides of ``section``, the key the error names).
    invalid: list[tuple[dict[str, Any], str]]
    #: Entered: the section of a sink whose destination is down (deliveries fail, retryably).
    outage: Outage | None
    #: Entered: the section of a sink whose destination accepts and never answers; on exit
    #: it answers again.
    hang: Outage | None
    #: The section and an event the destination can never take; None: the sink has no such case.
    permanent: tuple[dict[str, Any], EventEnvelope] | None
    #: Secrets in ``section`` besides those the sink registers through ``add_secret``.
    secrets: list[str] = field(default_factory=list)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed again on leaving)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def event(event_id: str, **overrides: Any) -> EventEnvelope:
    """A valid envelope (a ``RoomUserJoined``), with any field overridden."""
    return EventEnvelope.model_validate(
        {
            "event_id": event_id,
            "event_type": "RoomUserJoined",
            "app_code": "default",
            "room_id": "r_contract",
            "room_version": 1,
            "occurred_at_ms": 1764400000000,
            "payload": {"user_id": "u1"},
            **overrides,
        }
    )


class SinkContract:
    """Subclass as ``TestXSink`` with ``plugin`` (the module registering the sink), ``name``
    and a ``harness`` fixture. It checks:

    * **settings**: the registered model takes the harness's section, refuses an unknown key
      and each of the sink's own bad values with an error naming the key, and never echoes a
      secret;
    * **deliver**: an event arrives at the destination;
    * **failure classification**: an outage is a :class:`RetryableSinkError`, an event the
      destination can never take a :class:`PermanentSinkError`;
    * **timeouts**: a destination that stops answering never holds a delivery beyond the
      dispatcher's ``publish_timeout`` (the sink ends it, or yields to the deadline), and the
      same sink delivers again once the destination answers;
    * **aclose**: ends within a deadline whether or not the sink ever delivered;
    * **secrets**: no error raised in any of the above holds a secret the sink knows of.

    A sink without a failure mode (the noop sink) says so with ``None`` in its harness; that
    test is skipped with the reason."""

    pytestmark = pytest.mark.anyio

    plugin: ModuleType
    name: str

    # -- helpers -----------------------------------------------------------------------

    def spec(self) -> SinkSpec[Any]:
        return sink_spec(self.plugin, self.name)

    def settings(self, section: dict[str, Any]) -> SinkSettings:
        settings: SinkSettings = self.spec().settings_model.model_validate({"enabled": True, **section})
        return settings

    def make(self, section: dict[str, Any], secrets: list[str]) -> Sink:
        return make_sink(self.plugin, self.name, section, secrets)

    @asynccontextmanager
    async def opened(self, section: dict[str, Any], secrets: list[str]) -> AsyncIterator[Sink]:
        sink = self.make(section, secrets)
        try:
            yield sink
        finally:
            with anyio.fail_after(CLOSE_TIMEOUT):
                await sink.aclose()

    @staticmethod
    def assert_no_secret(text: str, harness: SinkHarness, registered: list[str]) -> None:
        for secret in (*harness.secrets, *registered):
            assert secret not in text, f"a secret ({len(secret)} characters) appears in: {text[:200]!r}"

    # -- settings ----------------------------------------------------------------------

    async def test_settings_model_takes_the_section(self, harness: SinkHarness) -> None:
        assert issubclass(self.spec().settings_model, SinkSettings)
        assert self.settings(harness.section).enabled

    async def test_an_unknown_key_is_named(self, harness: SinkHarness) -> None:
        with pytest.raises(ValidationError) as caught:
            self.settings({**harness.section, "no_such_key": 1})
        assert f"sinks.{self.name}.no_such_key" in describe_validation_error(caught.value, prefix=f"sinks.{self.name}")

    async def test_bad_values_are_named_and_secrets_not_echoed(self, harness: SinkHarness) -> None:
        assert harness.invalid, "name at least one bad value of the sink's own keys"
        for overrides, key in harness.invalid:
            with pytest.raises(ValidationError) as caught:
                self.settings({**harness.section, **overrides})
            text = describe_validation_error(caught.value, prefix=f"sinks.{self.name}")
            assert f"sinks.{self.name}.{key}" in text, text
            self.assert_no_secret(text, harness, [])

    # -- delivery ----------------------------------------------------------------------

    async def test_delivers(self, harness: SinkHarness) -> None:
        registered: list[str] = []
        async with self.opened(harness.section, registered) as sink:
            sent = event("contract-deliver")
            with anyio.fail_after(PUBLISH_TIMEOUT):
                await sink.deliver(sent)
            assert await harness.delivered(sent)

    async def test_an_outage_is_retryable_and_names_no_secret(self, harness: SinkHarness) -> None:
        if harness.outage is None:
            pytest.skip(f"{self.name} has no destination that can be down")
        registered: list[str] = []
        async with harness.outage() as section, self.opened(section, registered) as sink:
            with pytest.raises(RetryableSinkError) as caught, anyio.fail_after(PUBLISH_TIMEOUT * 5):
                await sink.deliver(event("contract-outage"))
        self.assert_no_secret(str(caught.value), harness, registered)

    async def test_what_can_never_succeed_is_permanent_and_names_no_secret(self, harness: SinkHarness) -> None:
        if harness.permanent is None:
            pytest.skip(f"{self.name} takes every event it is given")
        section, refused = harness.permanent
        registered: list[str] = []
        async with self.opened(section, registered) as sink:
            with pytest.raises(PermanentSinkError) as caught, anyio.fail_after(PUBLISH_TIMEOUT):
                await sink.deliver(refused)
        self.assert_no_secret(str(caught.value), harness, registered)
        assert not await harness.delivered(refused)

    async def test_a_silent_destination_is_bounded_and_the_sink_recovers(self, harness: SinkHarness) -> None:
        if harness.hang is None:
            pytest.skip(f"{self.name} has no destination that can stop answering")
        registered: list[str] = []
        sink: Sink | None = None
        try:
            async with harness.hang() as section:
                sink = self.make(section, registered)
                await self._bounded_while_silent(sink, harness, registered)
            # The destination answers again: the same sink delivers (what a cancelled
            # delivery left behind, a connection mid-request say, is not reused as healthy).
            back = event("contract-after-silence")
            with anyio.fail_after(PUBLISH_TIMEOUT * 5):
                await sink.deliver(back)
            assert await harness.delivered(back)
        finally:
            if sink is not None:
                with anyio.fail_after(CLOSE_TIMEOUT):
                    await sink.aclose()

    async def _bounded_while_silent(self, sink: Sink, harness: SinkHarness, registered: list[str]) -> None:
        started = anyio.current_time()
        with anyio.move_on_after(PUBLISH_TIMEOUT) as deadline:
            try:
                await sink.deliver(event("contract-silent"))
            except RetryableSinkError as exc:  # the sink's own timeout, before the dispatcher's
                self.assert_no_secret(str(exc), harness, registered)
            else:
                raise AssertionError("a destination that never answers took the event")
        # Cancelled at the deadline (the dispatcher's fail_after) or failed before it: never later.
        assert deadline.cancelled_caught or anyio.current_time() - started < PUBLISH_TIMEOUT

    # -- aclose ------------------------------------------------------------------------

    async def test_aclose_without_delivering(self, harness: SinkHarness) -> None:
        sink = self.make(harness.section, [])
        with anyio.fail_after(CLOSE_TIMEOUT):
            await sink.aclose()

    async def test_aclose_after_delivering(self, harness: SinkHarness) -> None:
        sink = self.make(harness.section, [])
        with anyio.fail_after(PUBLISH_TIMEOUT):
            await sink.deliver(event("contract-before-close"))
        with anyio.fail_after(CLOSE_TIMEOUT):
            await sink.aclose()


# -- the harness: a sink against events, no database, no dispatcher ---------------------------


def sink_spec(plugin: ModuleType, name: str) -> SinkSpec[Any]:
    """The :class:`SinkSpec` named ``name`` that ``plugin`` (a module with the hook) registers."""
    specs: dict[str, SinkSpec[Any]] = {spec.name: spec for spec in plugin.room_outbox_register_sinks()}
    if name not in specs:
        raise LookupError(f"{plugin.__name__} registers no sink {name!r} (it registers: {', '.join(specs) or 'none'})")
    return specs[name]


def make_sink(
    plugin: ModuleType, name: str, section: Mapping[str, Any] | None = None, secrets: list[str] | None = None
) -> Sink:
    """The sink as the core builds it: ``section`` (``sinks.<name>``) validated by its model,
    enabled; the secrets it registers are appended to ``secrets``."""
    spec = sink_spec(plugin, name)
    settings = spec.settings_model.model_validate({"enabled": True, **(section or {})})
    registered = secrets if secrets is not None else []
    return spec.factory(
        settings, SinkContext("testing", logging.getLogger(f"room_outbox.sink.{name}"), registered.append)
    )


@dataclass(frozen=True)
class SinkOutcome:
    """What one ``deliver`` did: nothing raised, or the error it raised."""

    event_id: str
    error: Exception | None

    @property
    def delivered(self) -> bool:
        return self.error is None

    @property
    def permanent(self) -> bool:
        """Parked by the dispatcher: never retried."""
        return isinstance(self.error, PermanentSinkError)

    @property
    def throttled(self) -> bool:
        """Held back by the sink's own limit: nothing sent, no attempt counted."""
        return isinstance(self.error, ThrottledSinkError)

    @property
    def retryable(self) -> bool:
        """Retried by the dispatcher (a timeout and a sink's bug included)."""
        return self.error is not None and not self.permanent and not self.throttled


async def deliver_events(
    sink: Sink, events: Iterable[EventEnvelope | Mapping[str, Any]], publish_timeout: float = PUBLISH_TIMEOUT
) -> list[SinkOutcome]:
    """Deliver each event in turn, each within ``publish_timeout`` (as the dispatcher bounds a
    delivery), and say what each did. A mapping is validated as an envelope first."""
    outcomes = []
    for item in events:
        envelope = item if isinstance(item, EventEnvelope) else EventEnvelope.model_validate(item)
        try:
            with anyio.fail_after(publish_timeout):
                await sink.deliver(envelope)
        except Exception as exc:  # what the dispatcher would classify: see SinkOutcome
            outcomes.append(SinkOutcome(envelope.event_id, exc))
        else:
            outcomes.append(SinkOutcome(envelope.event_id, None))
    return outcomes
