"""Measured overlap: a profile's timed events beside the modelled report."""
