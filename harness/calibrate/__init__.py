"""Fitting a simulated-device profile: to a real run's iterations, or to measured kernel tables."""
