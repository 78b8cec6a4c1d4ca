"""`hybridflow serve`: the built-in engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""
