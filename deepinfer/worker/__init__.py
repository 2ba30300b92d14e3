"""Turns step plans into tensors, runs the model and samples."""
