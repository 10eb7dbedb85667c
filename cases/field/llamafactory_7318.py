"""hiyouga/LlamaFactory#7318: neat_packing isolated each document's attention but not its positions.

``neat_packing`` built a block-diagonal 4-D attention mask for the packed rows but passed no per-document
``position_ids``, so the model's default positions ran on over the row: the second and later documents of a row were
embedded at positions their unpacked selves never have, and training differed from training without packing. The
merged pull gives ``PackedSupervisedDatasetProcessor`` each document's own ``position_ids``. The row: a team's step
packs each global batch's documents into rows, attention kept within documents by a mask from document ids (a 4-D
mask as neat_packing's), positions counted over the row as reported or restarted per document as fixed; held to the
same model on the documents padded one a row.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import packed_sequence_mask, packing_case, stream, token_mean_step

BUG = Bug("hiyouga/LlamaFactory", "pull", 7318, "packing",
          "neat_packing: a 4-D block mask but no position_ids: later documents embedded at run-on positions", fix_acts="forward")

CASE = packing_case("field_llamafactory_7318")


def neat_packing_step(model, optimizer, batch, position_ids_passed):
    """neat_packing: each row's documents isolated by a 4-D block mask; their positions passed, or left to the
    model's default (the row's slot indices)."""
    input_ids, position_ids, labels = stream(*batch)
    block_mask = packed_sequence_mask(position_ids)[:, None]
    return token_mean_step(model, optimizer, input_ids, position_ids if position_ids_passed else None, labels,
                           block_mask)


def train_step_as_reported(model, optimizer, batch):
    return neat_packing_step(model, optimizer, batch, position_ids_passed=False)


def train_step(model, optimizer, batch):
    return neat_packing_step(model, optimizer, batch, position_ids_passed=True)


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
