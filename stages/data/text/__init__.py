"""Text sources into token artifacts: ``shard_text(config, source, out)``; the reader is
``sluice.storage.tokens.open_token_split``."""
from sluice.stages.data.text.config import TextShardConfig
from sluice.stages.data.text.shard import TextShardSummary, shard_text
from sluice.stages.data.text.sources import detect_text_source

__all__ = ["TextShardConfig", "TextShardSummary", "shard_text", "detect_text_source"]
