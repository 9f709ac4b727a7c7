"""The ``qlora-kit`` command line.

- ``app``: the typer app, one thin function per subcommand;
- ``exits``: how a command ends: user mistakes as one line and exit code 2, a stopped run's code;
- ``recipes``: ``qlora-kit recipes`` lists, shows and copies out the shipped recipes;
- ``talking``: ``qlora-kit generate`` and ``qlora-kit chat`` (the trained adapter answering, streamed);
- ``exporting``: ``qlora-kit merge`` and ``qlora-kit export`` (a model to serve, with its parity report);
- ``views``: rich tables and lines (a run, a run folder, the data view, an evaluation, an export);
- ``plan_views``: ``qlora-kit plan``'s tables, and its figures as a dict (``--json``);
- ``doctor``: prove a machine and plan a recipe on it;
- ``logging_setup``: qlora_kit's log lines on stderr, rich on a terminal and plain elsewhere.

Modules are imported by path (``from qlora_kit.cli import views``); this file imports nothing, so
``qlora-kit --help`` loads no torch.
"""
