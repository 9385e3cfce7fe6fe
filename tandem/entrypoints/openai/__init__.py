"""OpenAI-compatible HTTP server: protocol models, serving logic, FastAPI app, metrics."""
