"""Transforms applied to a built model (as gpt-fast applies quantization): model files stay plain PyTorch."""
