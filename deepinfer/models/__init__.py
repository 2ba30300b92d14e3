"""Model files (loader, GGUF reading) and model implementations."""
