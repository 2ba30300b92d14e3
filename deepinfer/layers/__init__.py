"""Plain PyTorch building blocks shared by the model files."""
