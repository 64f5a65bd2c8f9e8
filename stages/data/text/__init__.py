"""Text sources into token artifacts: ``shard_text(config, source, out)``, the sources of one
mixture sharing ``shared_tokenizer(...)``; the reader is ``sluice.storage.tokens.open_token_split``."""
from sluice.stages.data.text.config import TextShardConfig
from sluice.stages.data.text.retokenize import RetokenizedSplit, retokenized, split_text_bytes
from sluice.stages.data.text.shard import TextShardSummary, shard_text
from sluice.stages.data.text.shared_tokenizer import shared_tokenizer
from sluice.stages.data.text.sources import detect_text_source

__all__ = ["TextShardConfig", "TextShardSummary", "shard_text", "shared_tokenizer", "retokenized",
           "RetokenizedSplit", "split_text_bytes", "detect_text_source"]
