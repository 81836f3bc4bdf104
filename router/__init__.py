"""OpenAI-compatible HTTP router: API, tokenization, prefix index, routing policy. Never imports torch."""
