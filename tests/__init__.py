"""The test suite. A package, so that pytest puts the repository root on the import path rather
than tests/: its helper modules (kernels.py, checkpoints.py, procs.py) must not shadow installed
packages of the same name (transformers imports Hugging Face's `kernels` when it is installed)."""
