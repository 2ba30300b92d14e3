"""OpenAI-compatible HTTP server: build_app(engine_client, settings) and `deepinfer serve`."""
