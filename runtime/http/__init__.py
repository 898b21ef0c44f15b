"""The HTTP server: the FastAPI app (server.py), the native and OpenAI routes, the error envelope (errors.py),
admission and disconnects (state.py, generation.py), metrics and the cache page."""
