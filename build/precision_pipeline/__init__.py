"""Precision-profile pipeline: profiles -> ModelOpt checkpoints -> gate -> trtllm-build -> Triton.

This package is the pipeline's source (not build output). ``build/`` is its source root (like
``src/``): ``tasks.py`` and pytest (``pythonpath = build``) put it on ``sys.path``, and
``pip install -e .`` (pyproject.toml) installs it. ``build/`` has no ``__init__.py``, so it never
shadows PyPA's ``build`` (``python -m build`` works in the repository root).
"""

__version__ = "0.1.0"
