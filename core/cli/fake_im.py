"""``room-outbox fake-im``: the fake Tencent IM as a process, for demos and local runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys

import anyio
from pydantic import ValidationError

from room_outbox.cli.command import Command, int_argument
from room_outbox.plugins.tencent_im.fake.im import DEFAULT_ADMIN, DEV_KEY, DEV_SDKAPPID, FakeTencentIM, Faults
from room_outbox.plugins.tencent_im.fake.server import serve_fake_im


def add_fake_im_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port", type=int_argument(0, 65535), default=8090, help="TCP port (0: any free port; default 8090)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--sdkappid",
        type=int_argument(1, 2**63 - 1),
        default=DEV_SDKAPPID,
        help=f"SDKAppID it serves (default {DEV_SDKAPPID})",
    )
    parser.add_argument(
        "--key",
        default=os.environ.get("ROOM_OUTBOX_FAKE_IM_KEY", DEV_KEY),
        help="secret key UserSigs are checked against (default: $ROOM_OUTBOX_FAKE_IM_KEY or the dev key)",
    )
    parser.add_argument("--identifier", default=DEFAULT_ADMIN, help=f"admin identifier (default {DEFAULT_ADMIN})")
    parser.add_argument("--faults", default="{}", help="initial faults as JSON, e.g. '{\"error_rate\": 0.2}'")


def run_fake_im(args: argparse.Namespace) -> int:
    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        print(f"room-outbox fake-im: --faults: {exc}", file=sys.stderr)
        return 2
    fake = FakeTencentIM(apps={args.sdkappid: args.key}, admins={args.identifier}, faults=faults)
    problem = anyio.run(_serve, fake, args.host, args.port)
    if problem:
        print(f"room-outbox fake-im: {problem}", file=sys.stderr)
        return 2
    return 0


def parse_faults(text: str) -> Faults:
    """``--faults``; a ValueError whose text is one line naming each bad field (pydantic's own
    text spans lines, with the input and a web link, which an operator's terminal need not show)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    try:
        return Faults.model_validate(doc)
    except ValidationError as exc:
        known = ", ".join(Faults.model_fields)
        problems = []
        for error in exc.errors(include_url=False, include_input=False):
            field = ".".join(str(part) for part in error["loc"]) or "the faults"
            reason = {
                "extra_forbidden": f"no such fault (known: {known})",
                "model_type": 'a JSON object is expected, e.g. {"error_rate": 0.2}',
            }.get(error["type"], error["msg"])
            problems.append(f"{field}: {reason}")
        raise ValueError("; ".join(problems)) from None


async def _serve(fake: FakeTencentIM, host: str, port: int) -> str | None:
    """Serve until SIGTERM or SIGINT; what went wrong when it could not listen."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(serve_fake_im(fake, host, port))
        except OSError as exc:  # the port is taken, the address is not this machine's
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else str(exc)
            return f"cannot listen on {host}:{port}: {reason}"
        (app,) = fake.apps
        print(f"fake Tencent IM on {fake.base_url} (sdkappid {app}, identifier {', '.join(fake.admins)})", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
    return None


COMMAND = Command(
    description="Serve a fake Tencent IM REST API (send_group_msg and friends) with a control API for\n"
    "faults, for tests and local runs. Needs no configuration (it ignores --config).",
    examples="room-outbox fake-im --port 8090\nroom-outbox fake-im --port 0 --faults '{\"error_rate\": 0.2}'",
    needs="none",
    arguments=add_fake_im_arguments,
    run=lambda args, _parser: run_fake_im(args),
)
