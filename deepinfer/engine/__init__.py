"""The engine loop and its request/output bookkeeping."""
