"""Watching a run: its timeline, the progress display and the run summary.

The monitor reads what a run records; it never sits in the coordinator's
decision loop. ``timeline`` writes and follows ``RUN_DIR/timeline.jsonl``
(the catalog of records is ``elche.core.timeline``), ``progress`` is the
progress bar, ``summary`` assembles the run summary that ``elche.train``
returns and the CLI prints.
"""
