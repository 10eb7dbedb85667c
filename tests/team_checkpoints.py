"""A team's DDP step and its own checkpoint code, as teams write it (torch.save of state dicts on rank 0, every rank
loading), imported by name on the ranks: tests/test_resume.py checks them resumed."""

import os

import torch
import torch.distributed as dist


def step(model, optimizer, batch):
    """A faithful DDP step: each rank's loss sum over the global batch's samples, times the world size (DDP
    averages over the ranks)."""
    inputs, targets = batch
    optimizer.zero_grad()
    losses = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    (losses.sum() * dist.get_world_size() / (len(inputs) * dist.get_world_size())).backward()
    optimizer.step()
    return losses.mean().detach()


def save(model, optimizer, folder):
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(folder, "team.pt"))
    dist.barrier()


def load(model, optimizer, folder):
    state = torch.load(os.path.join(folder, "team.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def save_model_only(model, optimizer, folder):
    """The bug: the optimizer's state left out of the checkpoint."""
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict()}, os.path.join(folder, "team.pt"))
    dist.barrier()


def load_model_only(model, optimizer, folder):
    state = torch.load(os.path.join(folder, "team.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])


def load_nothing(model, optimizer, folder):
    """The bug: a load that reads the file and never applies it."""
    torch.load(os.path.join(folder, "team.pt"), weights_only=True)


# --- a team's loop, resumed: its own position (how many batches it has trained) is part of its checkpoint --------

POSITIONS = {}  # each run's loop position, by its optimizer (one per run)


def loop(model, optimizer, batches):
    """Skips the batches its restored position says it trained before the restart."""
    done = POSITIONS.setdefault(optimizer, 0)
    losses = []
    for index, batch in enumerate(batches):
        if index < done:
            continue
        losses.append(step(model, optimizer, batch))
        POSITIONS[optimizer] = index + 1
    return losses


def save_with_position(model, optimizer, folder):
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "position": POSITIONS[optimizer]}, os.path.join(folder, "team.pt"))
    dist.barrier()


def load_with_position(model, optimizer, folder):
    state = torch.load(os.path.join(folder, "team.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    POSITIONS[optimizer] = state["position"]


def load_without_position(model, optimizer, folder):
    """The bug: the position not restored, so the loop trains the first batches again."""
    load(model, optimizer, folder)
