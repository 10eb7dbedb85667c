"""Mechanics: the opt-in generated tests, one per (case, regime): ``test_equivalence[mlp-accumulate:chunks=5]``."""

from __future__ import annotations

import pytest

from .options import Settings

NAME = "test_equivalence"


class EquivalenceItem(pytest.Item):
    """One case under one regime; fails with equivcheck's description, not a traceback."""

    def __init__(self, *, case: str, regime: str, settings: Settings, **kwargs) -> None:
        super().__init__(**kwargs)
        self.case, self.regime, self._settings = case, regime, settings
        self.add_marker("equivcheck")

    def runtest(self) -> None:
        from .checker import Checker

        Checker(self, self._settings.defaults()).check(self.case, [self.regime])

    def repr_failure(self, excinfo, style=None):
        from equivcheck import NotEquivalent

        from .deadline import CheckTimeout

        if isinstance(excinfo.value, (NotEquivalent, CheckTimeout)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, 0, f"{self.case} under {self.regime}"  # a skip's report needs a line number


def planned(settings: Settings) -> list[tuple[str, str]]:
    """The (case, regime spec) pairs the options ask for; an unknown case or a bad spec is a usage error."""
    import equivcheck as ec

    try:
        registered = ec.all_cases()
        names = list(registered) if not settings.cases or "all" in settings.cases else list(settings.cases)
        for name in names:
            if name not in registered:
                raise ec.InvalidArgument.unknown("case", name, registered)
        specs = [str(ec.parse_regime(spec)) for spec in settings.regimes]
    except ec.InvalidArgument as error:
        raise pytest.UsageError(f"equivcheck: {error}") from None
    return [(name, spec) for name in names for spec in specs or ec.regimes_for(registered[name])]


def generate(session: pytest.Session, settings: Settings) -> list[EquivalenceItem]:
    """One test per planned pair. A regime that cannot run one of the cases (too many chunks for its batch, no split,
    no trunk that steps a token) is skipped there, saying why; a spec that fits none of them is a usage error, as it
    is on the command line."""
    import equivcheck as ec
    from equivcheck.check import misfits

    pairs = planned(settings)
    try:
        unfit = misfits([ec.get_case(name) for name in dict.fromkeys(name for name, _ in pairs)],
                        [ec.parse_regime(spec) for spec in dict.fromkeys(spec for _, spec in pairs)])
    except ec.InvalidArgument as error:
        raise pytest.UsageError(f"equivcheck: --equivcheck-regimes: {error}") from None
    items = []
    for name, spec in pairs:
        item = EquivalenceItem.from_parent(session, name=f"{NAME}[{name}-{spec}]", case=name, regime=spec,
                                           settings=settings)
        if (name, spec) in unfit:
            item.add_marker(pytest.mark.skip(reason=unfit[(name, spec)]))
        items.append(item)
    return items
