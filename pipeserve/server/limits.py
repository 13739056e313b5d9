"""The server's default bounds, apart from the app so that the CLI's parser needs no web stack."""

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Sequences (running + waiting) the server holds at once; beyond it 429 (vLLM has no bound, but an
# unbounded queue lets one client starve the rest for ever).
DEFAULT_MAX_QUEUE = 4096
