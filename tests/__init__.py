# A package, so pytest puts the repository root on sys.path, not tests/: tests/kernels, tests/profile and
# tests/bench would otherwise shadow top-level modules of the same name (transformers imports the PyPI
# `kernels` package when it is installed, and `profile` is in the standard library).
