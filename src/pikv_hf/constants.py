"""Names shared by the transformers glue and the cache layers."""

ATTN_IMPLEMENTATION = "pikv"  # the attention / mask implementation name registered with transformers
