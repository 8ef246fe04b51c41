"""Asynchronous collectives as futures. Design notes: README.md beside this file."""
