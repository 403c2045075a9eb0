from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from room_outbox.plugins.tencent_im.fake import FakeTencentIM, serve_fake_im


@pytest.fixture
async def fake() -> AsyncIterator[FakeTencentIM]:
    """A fake Tencent IM on a free loopback port, with the dev SDKAppID and key."""
    async with serve_fake_im(FakeTencentIM(seed=7)) as fake:
        yield fake
