"""The ``layernorm`` command: one module per sub-command, argparse and formatting only.

Each module has ``add_arguments(parser)`` and ``run(args) -> exit status``, and the ones that
contribute to ``layernorm report`` a ``report_section(ctx) -> Markdown``; the computation they
print lives in the library (:mod:`layernorm.selfcheck`, :mod:`layernorm.stability`,
:mod:`layernorm.cost`, :mod:`layernorm.bench`).
"""
