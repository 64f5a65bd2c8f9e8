"""Sluice stages: plain functions and classes that read and write artifacts.

Nothing here imports Prefect, and heavy backends (FFCV, DALI) are imported only when asked for.
"""
