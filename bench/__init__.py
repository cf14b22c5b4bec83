"""Benchmarks, each runnable as ``python bench/NAME.py`` from the repository root; shared
pieces (the bench harness) are imported as ``bench.<module>``. The runtime never imports
this package."""
