"""The test suite, one folder per package it tests (tiers are pytest markers, see conftest.py)."""
