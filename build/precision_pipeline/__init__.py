"""Precision-profile pipeline: profiles -> ModelOpt checkpoints -> gate -> trtllm-build -> Triton.

This package is the pipeline's source (not build output). It shadows PyPA's ``build``
module on ``sys.path`` when the repository root is first on the path, which is how
``tasks.py`` and the tests import it.
"""

__version__ = "0.1.0"
