"""Schedules and windows: collectives paired from start to done."""
