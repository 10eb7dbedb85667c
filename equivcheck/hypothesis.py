"""The hypothesis strategies' earlier name, kept for one release: ``equivcheck.hypothesis`` is :mod:`equivcheck.strategies`."""

import sys

from . import strategies

sys.modules[__name__] = strategies
