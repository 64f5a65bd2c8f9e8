"""The on-disk formats a dataset artifact holds: WebDataset tar shards with their DALI index
(``tar``), and the FFCV ``.beton`` (``ffcv``)."""
