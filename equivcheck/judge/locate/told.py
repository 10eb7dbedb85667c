"""What a walk was shown of each module it passed: alike, given otherwise, or unseen with why."""

from __future__ import annotations


UNSEEN = "not recorded in the run (replaced during the step, compiled, or not called)"


class Told:
    """What a walk was shown of each module it passed, in its order: alike (every call of it compared and computed
    alike from what the reference's was given), given otherwise (compared: what it was handed differs, which the code
    around it made), or unseen with why (not recorded, not told). A module the walk never reached is unseen too."""

    def __init__(self) -> None:
        self._unseen: dict[str, str] = {}
        self._given_otherwise: set[str] = set()
        self._alike: set[str] = set()

    def alike(self, module: str) -> None:
        self._alike.add(module)

    def given_otherwise(self, module: str) -> None:
        self._given_otherwise.add(module)

    def unseen(self, module: str, why: str) -> None:
        self._unseen.setdefault(module, why)

    def seen(self, module: str) -> bool:
        return module not in self._unseen and (module in self._alike or module in self._given_otherwise)

    def is_alike(self, module: str) -> bool:
        return self.seen(module) and module not in self._given_otherwise

    def why(self, modules: list[str]) -> dict[str, list[str]]:
        """``modules`` grouped by why each was not seen."""
        grouped: dict[str, list[str]] = {}
        for module in modules:
            grouped.setdefault(self._unseen.get(module, "not reached before it"), []).append(module)
        return grouped


def shown(modules: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in modules[:4]) + (", ..." if len(modules) > 4 else "")
