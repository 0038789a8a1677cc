"""The ``oomcast`` command: one entry point, a module per family of subcommands."""
