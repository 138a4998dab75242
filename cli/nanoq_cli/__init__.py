"""The ``nanoq`` command line (click); the entry point is ``nanoq_cli.main:main`` (``cli`` under the abort-on-failure guard of nanoq.distributed)."""
