"""HTTP gateway: OpenAI-compatible API, tokenization, incremental detokenization, SSE. Never imports torch."""
