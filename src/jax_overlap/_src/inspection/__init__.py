"""Seeing the overlap: schedules, a cost model, the report and its pictures."""
