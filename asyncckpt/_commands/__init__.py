"""Subcommands of the ``asyncckpt`` command line, one module each (see :mod:`asyncckpt.cli`)."""
