"""A case goes to ranks as it is defined: bound at the top level of a module, a test file or the script being run,
registered or not, found there by identity; one built inside a function is refused with the two-line fix. The docs'
examples that check on ranks run as written (the README's CI gate: tests/test_pytest_plugin.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.process.import_paths import bound_path

SOURCE_TREE = Path(os.environ.get("EQUIVCHECK_SOURCE_TREE") or Path(__file__).parents[1]).resolve()

CHECK_CALL = re.compile(r"^(?:\w+ = )?ec\.check_(?:step|loop|eval)\(.*world_size=\d")

# What the docs' examples take as given: their imports and a registered case named "my_case"
PRELUDE = '''
import torch, torch.nn.functional as F
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, DistributedSampler, Subset
import equivcheck as ec

MY_CASE = ec.register_case(ec.Case(
    name="my_case", model=lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)),
    data=lambda: (torch.randn(24, 5), torch.randint(0, 3, (24,))),
    loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=8, steps=3))
'''


def ranks_examples() -> dict[str, str]:
    """Every Python block of the docs that calls a check on ranks, by page and line."""
    found = {}
    for page in sorted((SOURCE_TREE / "docs").glob("*.md")):
        text = page.read_text()
        for block in re.finditer(r"```python\n(.*?)```", text, re.S):
            if any(CHECK_CALL.match(line) for line in block.group(1).splitlines()):
                found[f"{page.name}:{text[:block.start()].count(chr(10)) + 1}"] = block.group(1)
    return found


def as_script(block: str) -> str:
    """The block as a script: its definitions at the top level, its check (from the first check call on) under the
    main guard, run as written on ranks, then, a step's or a loop's but a pipeline's, in this process (without
    world_size=)."""
    lines = block.splitlines()
    first = next(i for i, line in enumerate(lines) if CHECK_CALL.match(line))
    call = "\n".join(lines[first:])
    in_process = "" if "check_eval" in call or "pipeline=True" in call else call.replace(", world_size=2", "")
    return (PRELUDE + "\n".join(lines[:first]) + '\n\nif __name__ == "__main__":\n'
            + textwrap.indent(call + "\n" + in_process + "\nprint('examples ran')\n", "    "))


def run_script(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=path.parent)


@pytest.mark.full_only  # three scripts that start ranks, 30 to 40 s: make test-full
def test_the_docs_examples_that_check_on_ranks_run_as_written(tmp_path):
    examples = ranks_examples()
    # a new example that checks on ranks joins this test by itself
    assert sorted(where.split(":")[0] for where in examples) == ["cases.md", "evaluation.md", "parallel.md"]
    for where, block in examples.items():
        script = tmp_path / f"example_{where.replace('.md:', '_')}.py"
        script.write_text(as_script(block))
        done = run_script(script)
        assert done.returncode == 0 and "examples ran" in done.stdout, f"{where}:\n{done.stderr[-3000:]}"


TEAM_MODULE = '''
import torch, torch.nn.functional as F
from torch import nn
import equivcheck as ec

IMPORTED = ec.Case(name="imported_unregistered",
                   model=lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
                   data=lambda: (torch.randn(24, 4), torch.randint(0, 3, (24,))),
                   loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=8, steps=3)
'''

SCRIPT = '''
import json
import torch, torch.nn.functional as F
from torch import nn
import equivcheck as ec
from team_cases import IMPORTED

CASE = ec.Case(name="script_unregistered", model=lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
               data=lambda: (torch.randn(24, 4), torch.randint(0, 3, (24,))),
               loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=8, steps=3)


def step(model, optimizer, batch, scale=1.0):
    inputs, targets = batch
    optimizer.zero_grad()
    (F.cross_entropy(model(inputs), targets) * scale).backward()
    optimizer.step()


def doubled(model, optimizer, batch):
    step(model, optimizer, batch, scale=2.0)


if __name__ == "__main__":
    verdicts = {f"{case.name} {fn.__name__}": ec.check_step(case, fn, world_size=2).outcomes[0].verdict.value
                for case in (CASE, IMPORTED) for fn in (step, doubled)}
    print(json.dumps(verdicts))
'''


def test_a_case_defined_in_the_script_or_a_module_it_imports_goes_to_ranks_unregistered(tmp_path):
    (tmp_path / "team_cases.py").write_text(TEAM_MODULE)
    (tmp_path / "check_team.py").write_text(SCRIPT)
    done = run_script(tmp_path / "check_team.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == (
        '{"script_unregistered step": "equivalent", "script_unregistered doubled": "mismatch", '
        '"imported_unregistered step": "equivalent", "imported_unregistered doubled": "mismatch"}')


def scaled_step(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()


UNREGISTERED = dataclasses.replace(ec.get_case("mlp"), name="bound_here_unregistered")


def test_a_case_bound_at_a_test_modules_top_level_is_found_by_identity():
    assert bound_path(UNREGISTERED) == f"{__name__}:UNREGISTERED"
    assert bound_path(dataclasses.replace(UNREGISTERED)) is None  # an equal case is another object
    (outcome,) = ec.check_step(UNREGISTERED, scaled_step, world_size=2).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT


def test_a_case_built_inside_a_function_is_refused_with_the_two_line_fix():
    inside = dataclasses.replace(ec.get_case("mlp"), name="built_inside")
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.check_step(inside, scaled_step, world_size=2)
    message = str(raised.value)
    assert message.startswith("case='built_inside' is not allowed here: worker processes import the case by the name ")
    here = sys._getframe().f_code.co_name
    assert f"built inside {here}() at {__file__}:" in message
    assert message.endswith("\n    CASE = ec.Case(name='built_inside', ...)  # at the top level of the module\n"
                            "    equivcheck.check_step(CASE, train_step, world_size=2)  # in a test, or under "
                            "`if __name__ == \"__main__\":`")
