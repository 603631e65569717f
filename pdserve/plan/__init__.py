"""Capacity planning from measurements: `pdserve profile` measures this machine's engine and fits a
cost model to it (profile.py, fit.py)."""
