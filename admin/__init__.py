"""The operators' command line, `loraplex-admin` (see admin/cli.py)."""
