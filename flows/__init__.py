"""Sluice flows and CLI: thin Prefect flows that chain stages; no stage logic lives here."""
