"""The walk over one traced step: its readings tried in the order a step runs them; the first that holds answers."""

from __future__ import annotations

from ...diff import Location
from .after_backward import AfterBackward
from .backward import Backward
from .carried import Carried
from .forward import Forward
from .loss import Loss


class Walk(Carried, Forward, Loss, Backward, AfterBackward):
    """The phases of one traced step, tried in order against the reference's trace."""

    def first(self) -> Location | None:
        for phase in (self._carried, self._buffers_carried, self._forward, self._loss, self._backward,
                      self._after_backward):
            found = phase()
            if found is not None:
                return found
        return None
