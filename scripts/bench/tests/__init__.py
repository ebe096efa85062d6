"""Tests of the bench scripts' parsing (run by scripts/check/test-python.sh)."""
