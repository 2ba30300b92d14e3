"""Expert parallelism; eplb.py is the expert-placement policy (pure numpy, no torch)."""
