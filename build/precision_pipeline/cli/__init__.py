"""The command line's package side: what each ``invoke`` task in ``tasks.py`` calls (parse, one call, print).

``console``: the rich console, the one rendering of errors (exit codes from ``core.errors.exit_code_for``)
and the flag parsers; ``build``: build, check, profiles; ``serving``: serve, promote, rollback, rollout,
probe, releases; ``choose``: recommend, compare; ``sensitivity``: the per-layer analysis.
"""
