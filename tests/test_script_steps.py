"""A team's code for ranks found by the name it is bound to: in the script being run (`python check_fsdp.py`), as
multiprocessing's spawn finds it, and a factory's step or a functools.partial bound at the top level of a module."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.process.import_paths import import_path


def scaled_step(model, optimizer, batch, scale=1.0):
    inputs, targets = batch
    optimizer.zero_grad()
    (F.cross_entropy(model(inputs), targets) * scale).backward()
    optimizer.step()


def make_step(scale: float):
    def factory(model, optimizer, batch):
        scaled_step(model, optimizer, batch, scale)
    return factory


FAITHFUL_FROM_A_FACTORY = make_step(1.0)  # __qualname__ 'make_step.<locals>.factory': found by its name here
DOUBLED_FROM_A_FACTORY = make_step(2.0)
FAITHFUL_PARTIAL = functools.partial(scaled_step, scale=1.0)


@pytest.mark.parametrize(("step", "verdict"), [(FAITHFUL_FROM_A_FACTORY, ec.Verdict.EQUIVALENT),
                                               (DOUBLED_FROM_A_FACTORY, ec.Verdict.MISMATCH),
                                               (FAITHFUL_PARTIAL, ec.Verdict.EQUIVALENT)])
def test_a_factorys_step_or_a_partial_bound_at_the_top_level_runs_on_ranks(step, verdict):
    (outcome,) = ec.check_step("mlp", step, world_size=2).outcomes
    assert outcome.verdict is verdict
    name = next(name for name, value in globals().items() if value is step)
    assert outcome.regime.endswith(f"fn=test_script_steps:{name}")


def test_an_object_bound_nowhere_is_refused_with_the_name_to_bind():
    with pytest.raises(ec.InvalidArgument, match=r"step=functools.partial\(.*\) is not allowed: expected a function, or "
                                                 r"an object bound to a name, at the top level .* qualifies once bound "
                                                 r"to a name there \(`fast_step = make_step\(chunks=4\)`\)"):
        import_path(functools.partial(scaled_step, scale=3.0))
    assert import_path(scaled_step) == "test_script_steps:scaled_step"  # its own name first


SCRIPT = '''
import functools, json, os, sys
import torch, torch.nn.functional as F
import equivcheck as ec

with open(os.environ["MARKS"], "a") as marks:  # the top level: once in this process and once in each rank
    marks.write(f"top {os.getpid()}\\n")

CASE = ec.register_case(ec.Case(
    name="script_mlp", model=lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)),
    data=lambda: (torch.randn(24, 4), torch.randint(0, 3, (24,))), loss=functools.partial(F.cross_entropy, reduction="none"),
    batch_size=8, steps=3))


def step(model, optimizer, batch, scale=1.0):
    inputs, targets = batch
    optimizer.zero_grad()
    (F.cross_entropy(model(inputs), targets) * scale).backward()
    optimizer.step()


def make_step(scale):
    def factory(model, optimizer, batch):
        step(model, optimizer, batch, scale)
    return factory


def loop(model, optimizer, batches):
    for inputs, targets in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def wrap(model):
    return torch.nn.parallel.DistributedDataParallel(model)


halved = make_step(0.5)
partial_step = functools.partial(step, scale=1.0)

{call}
'''

GUARDED = '''
if __name__ == "__main__":
    with open(os.environ["MARKS"], "a") as marks:
        marks.write("guarded\\n")
    verdicts = {name: ec.check_step(CASE, fn, world_size=2, wrap=wrap).outcomes[0].verdict.value
                for name, fn in (("step", step), ("halved", halved), ("partial", partial_step))}
    verdicts["loop"] = ec.check_loop(CASE, loop, world_size=2).outcomes[0].verdict.value
    print(json.dumps(verdicts))
'''

UNGUARDED = '''
print(ec.check_step(CASE, step, world_size=2).outcomes[0].verdict.value)
'''


def run_script(tmp_path, call: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    script, marks = tmp_path / "check_team_step.py", tmp_path / "marks.txt"
    script.write_text(SCRIPT.replace("{call}", textwrap.dedent(call)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "MARKS": str(marks)}, cwd=tmp_path)
    return done, marks.read_text().splitlines()


def test_a_step_case_and_wrap_defined_in_the_script_being_run_are_checked_on_ranks(tmp_path):
    done, marks = run_script(tmp_path, GUARDED)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "step": "equivalent", "halved": "mismatch", "partial": "equivalent", "loop": "equivalent"}
    assert marks.count("guarded") == 1  # the guarded part ran here alone
    tops = [mark for mark in marks if mark.startswith("top ")]
    assert len(tops) == len(set(tops)) == 3  # the top level once here and once in each of the 2 ranks


def test_a_script_that_checks_outside_its_main_guard_is_stopped_before_anything_runs(tmp_path):
    done, marks = run_script(tmp_path, UNGUARDED)
    assert done.returncode != 0
    assert "is not allowed here: it is defined in the script being run" in done.stderr
    assert "outside `if __name__ == \"__main__\":`: it would run again in every rank" in done.stderr
    assert marks == [marks[0]] and marks[0].startswith("top ")  # no rank ever imported the script
