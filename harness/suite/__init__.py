"""Suites: several runs from a TOML file (sequential or on Ray), and the capacity search over rates."""
