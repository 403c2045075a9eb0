"""``python -m room_outbox.cli``: the ``room-outbox`` command."""

from __future__ import annotations

import sys

from room_outbox.cli.main import main

sys.exit(main())
