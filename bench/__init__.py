"""draftstream benchmarks: each measures draftstream and its reference in one run and prints the ratio."""
