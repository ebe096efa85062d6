"""Tests of the learning loop's logic (run by scripts/check/test-python.sh)."""
