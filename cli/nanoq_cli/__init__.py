"""The ``nanoq`` command line (click); the entry point is ``nanoq_cli.main:cli``."""
