"""Every ``paasbench`` subcommand, one module per command, all in one style.

A command parses and validates its options, calls the library functions that do the work, and prints; errors
reach the exit code through :mod:`paas_common.errors` (``InputError`` 2, ``RunFailed`` 1, ``SLOBreach`` 99). No
measuring, fitting or rendering logic lives here. :mod:`paasbench.cli` imports a module only when its command
is looked up, and a module imports little at the top (heavy imports wait inside the command), so
``paasbench --help`` stays fast.
"""
