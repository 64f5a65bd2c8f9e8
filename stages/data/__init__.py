"""Source data → a versioned dataset artifact: sources, the split, per-sample encoding, the
shard writers (WebDataset tar + DALI index, FFCV ``.beton``) and the sharding stage."""
