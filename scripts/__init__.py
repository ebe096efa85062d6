"""The repository's Python tooling, one package so that a script imports another's code by name
(`from scripts.lib.common import free_port`, `from scripts.reference import numpy_decoder`) with
no `sys.path` patching. A script that does runs as a module from the repository root:

  python3 -m scripts.bench.soak --help

One that imports nothing of the repository's also runs as a file (`python3 scripts/check/maps.py`).
scripts/README.md lists them all.
"""
