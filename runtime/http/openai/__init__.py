"""The OpenAI-compatible API: request models, the error envelope, and the chat / completions routes."""
