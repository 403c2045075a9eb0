"""What a consumer says when it cannot join its group or fetch, and the one refusal that stops it.

A broker that does not answer (down, unreachable, its coordinator moving) is waited for: the
consumer tries again and says "broker unavailable". Any other refusal of the join is the
group's or the configuration's, not the broker's health: it is named by its Kafka error class
with the fix, once while it lasts (the consumer still tries again: an ACL granted or another
application gone, it joins). A session timeout outside the broker's limits never joins: it
stops the process, naming the setting and both values.

A member's fetch says the errors of its client's group routines too (a rejoin refused, a
heartbeat refused): the broker unavailable or the group moved on (the client rejoins by
itself) is a warning, any other refusal the same error and fix as for the join, each once
while it lasts; the consumer fetches again. A client whose group routine ended on an error
cannot go on (:func:`client_broken`): it is no longer a member, and the consumer joins again
with a new one.
"""

from __future__ import annotations

import logging

import anyio
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    IllegalGenerationError,
    InconsistentGroupProtocolError,
    InvalidGroupIdError,
    InvalidSessionTimeoutError,
    KafkaError,
    KafkaTimeoutError,
    RebalanceInProgressError,
    TopicAuthorizationFailedError,
    UnknownMemberIdError,
)

from room_outbox.config import ConfigError
from room_outbox.consume.broker_calls import Abandoned
from room_outbox.consume.settings import ConsumerSettings

#: The broker settings that bound a member's session timeout.
SESSION_LIMITS = ("group.min.session.timeout.ms", "group.max.session.timeout.ms")
#: Reading those limits from the broker, once the join was refused for them.
LIMITS_READ_TIMEOUT = 5.0

#: The fix for each refusal of a join that is not the broker being unavailable.
_HINTS: dict[type[KafkaError], str] = {
    GroupAuthorizationFailedError: "grant the client's principal READ on the group (consumers.<name>.group_id)",
    TopicAuthorizationFailedError: "grant the client's principal READ and DESCRIBE on the topic (consumers.<name>.topic)",
    InconsistentGroupProtocolError: (
        "the group's members use another protocol or partition assignor: another application uses this"
        " group id; give the consumer a group of its own (consumers.<name>.group_id)"
    ),
    InvalidGroupIdError: "the broker refuses the group id: set consumers.<name>.group_id",
    UnknownMemberIdError: (
        "the broker dropped this member (its session expired): it joins as a new member; if it recurs, raise"
        " consumers.<name>.session_timeout"
    ),
}


def broker_unavailable(exc: BaseException) -> bool:
    """Whether a failed join means the broker did not answer (and trying again is all to do),
    rather than a refusal of the join that needs a fix."""
    if isinstance(exc, (TimeoutError, OSError, Abandoned, KafkaTimeoutError)):
        return True
    return isinstance(exc, KafkaError) and bool(exc.retriable)


def refusal_hint(exc: BaseException, consumer: str) -> str:
    """One line on how to fix a refused join (``exc``: not :func:`broker_unavailable`)."""
    for kind, hint in _HINTS.items():
        if isinstance(exc, kind):
            return hint.replace("<name>", consumer)
    return "the broker's log says why"


def fetch_trouble(exc: BaseException, consumer: str) -> tuple[int, str]:
    """The level and the line a failed fetch is said with (once while it lasts): a warning
    where the client recovers by itself, the broker unavailable or the group moved on without
    the member (the client rejoins); an error naming the refusal and its fix otherwise."""
    kind = type(exc).__name__
    if broker_unavailable(exc):
        return logging.WARNING, f"broker unavailable ({kind}); fetching again"
    if isinstance(exc, (UnknownMemberIdError, IllegalGenerationError, RebalanceInProgressError)):
        return logging.WARNING, f"the group moved on without this member ({kind}): it rejoins; fetching again"
    return (
        logging.ERROR,
        f"the broker refuses the fetch or the group join ({kind}): {refusal_hint(exc, consumer)}; trying again",
    )


def client_broken(kafka: AIOKafkaConsumer) -> bool:
    """Whether the client's group coordination or heartbeat routine ended on an error: aiokafka
    then says that error at every fetch and never recovers (no heartbeat goes out, so the broker
    drops the member while it still fetches its partitions). One refused heartbeat is enough."""
    coordinator = kafka._coordinator
    routines = (getattr(coordinator, "_coordination_task", None), getattr(coordinator, "_heartbeat_task", None))
    return any(task is not None and task.done() and not task.cancelled() and task.exception() for task in routines)


async def session_timeout_refused(
    settings: ConsumerSettings, consumer: str, exc: InvalidSessionTimeoutError
) -> ConfigError:
    """The error that stops a consumer whose session timeout the broker refuses: the setting,
    its value and the broker's limits (as the broker reports them, when it does)."""
    setting = f"consumers.{consumer}.session_timeout"
    asked = f"{setting} is {settings.session_timeout:g}s ({int(settings.session_timeout * 1000)} ms)"
    try:
        with anyio.fail_after(LIMITS_READ_TIMEOUT):
            limits = await broker_session_limits(settings)
    except Exception as read_error:  # only the message is poorer for it
        limits = {}
        unread = f"{type(read_error).__name__}: {read_error}" if str(read_error) else type(read_error).__name__
    else:
        unread = "the broker does not report them"
    if limits:
        bounds = ", ".join(f"{name}={limits[name]}" for name in SESSION_LIMITS if name in limits)
    else:
        bounds = f"{' and '.join(SESSION_LIMITS)} not known ({unread})"
    return ConfigError(
        f"{setting}: the broker refuses the group's session timeout ({type(exc).__name__}): {asked}, the"
        f" broker's limits: {bounds}; set {setting} within them, or change the broker's limits"
    )


async def broker_session_limits(settings: ConsumerSettings) -> dict[str, str]:
    """The broker's session timeout limits (:data:`SESSION_LIMITS`) that it reports, by name."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers, request_timeout_ms=int(LIMITS_READ_TIMEOUT * 1000),
        **settings.security.client_kwargs(),
    )  # fmt: skip
    await admin.start()
    try:
        brokers = (await admin.describe_cluster())["brokers"]
        resources = [ConfigResource(ConfigResourceType.BROKER, str(broker["node_id"])) for broker in brokers[:1]]
        found: dict[str, str] = {}
        for response in await admin.describe_configs(resources):
            for resource in response.resources:
                for entry in resource[4]:
                    if entry[0] in SESSION_LIMITS and entry[1] is not None:
                        found[entry[0]] = entry[1]
        return found
    finally:
        await admin.close()
