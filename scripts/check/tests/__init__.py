"""Tests of the checks' parsers (run by scripts/check/test-python.sh)."""
