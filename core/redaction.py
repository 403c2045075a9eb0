"""Secrets never leave the process: every text bound for a log, a span or ``last_error``
passes through :meth:`Redactor.redact`, which replaces each registered secret."""

from __future__ import annotations

REDACTED = "[REDACTED]"


class Redactor:
    def __init__(self) -> None:
        self._secrets: set[str] = set()

    def add(self, secret: str) -> None:
        # Very short values would redact ordinary words; nothing real is that short.
        if len(secret) >= 4:
            self._secrets.add(secret)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text
