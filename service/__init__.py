"""Wiring of the Loraplex processes: settings and the embedded one-process server."""
