"""The benchmark suite of pml-hyperbolic: ``python -m bench --list``, ``python -m bench NAME [ARGS]``.

Each public module of this package is one benchmark with a ``main(argv)``; modules whose name starts
with ``_`` are shared code. See ``bench/README.md`` for the methodology and the result format.
"""
