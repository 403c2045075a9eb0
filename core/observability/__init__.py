"""Observability: logs, traces and metrics (telemetry), secret redaction, health, and the
HTTP endpoint serving /healthz, /readyz and /metrics."""
