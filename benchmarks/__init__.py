"""Benchmarks: they report figures; nothing here passes or fails on speed."""
