"""Measurements: speed and reuse, front doors, trained heads, score stability, the GPU check."""
