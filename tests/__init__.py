"""The test suite: one folder per package of pml_hyperbolic (and for bench/, recipes/, repository-wide checks)."""
