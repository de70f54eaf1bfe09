"""`pyspec-server`: a drop-in for llama.cpp's `llama-server` (same flags, endpoints and JSON).

Layout, one concern per file:
- args.py: the command line (llama-server's flags, short forms, defaults, LLAMA_ARG_* env vars).
- types.py: what the HTTP layer and the engine thread hand each other.
- scheduler.py: the engine thread: slots, the queue, continuous batching over `_core.SpecEngine`.
- params.py: request bodies -> GenerationRequest (llama.cpp's names, aliases, limits, defaults).
- responses.py: the JSON of every result (native, OpenAI completion and chat, stream chunks).
- metrics.py: /metrics (Prometheus text via prometheus_client).
- app.py: the FastAPI application: routes, API key, CORS, the 503 loading gate, errors.
- main.py: `pyspec-server` itself: parse flags, start uvicorn, load the model, serve.
"""
