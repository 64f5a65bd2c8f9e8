"""Sluice flows and CLI: thin Prefect flows that chain stages; no stage logic lives here."""
import os

# Before Prefect is imported anywhere through us: no telemetry (its heartbeat also races the
# embedded server's SQLite start-up), and room for the embedded API to start on a busy machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
