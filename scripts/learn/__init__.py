"""The learning loop: distill.py, the oracle judge and the loop's measurement."""
