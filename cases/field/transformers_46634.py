"""huggingface/transformers#46634: packed sequences' mask ignored when a 2-D attention_mask is passed.

``create_causal_mask`` (through ``_preprocess_mask_arguments`` in ``masking_utils.py``) detected packed sequences from
``position_ids`` only when ``attention_mask is None``. Packed and remove-padding trainers pass an all-ones 2-D mask,
so the packed-sequence mask stayed None, SDPA took the ``is_causal`` path, and each document attended to the earlier
documents of its row; the loss still fell. The pull drops the ``attention_mask is None`` clause from the gate (closed;
whether it merged is not verified here, the mechanism is plain). The row: a team's step packs each global batch's
documents into rows with ``position_ids`` restarting per document and passes the all-ones mask, under the model with
the gate as reported and as the pull sets it; held to the same model on the documents padded one a row.
"""

import torch

from equivcheck.suites.field import Bug
import equivcheck as ec
from equivcheck_cases.field._packing import packing_case, stream, token_mean_step

BUG = Bug("huggingface/transformers", "pull", 46634, "packing",
          "packing found only without attention_mask: an all-ones 2-D mask let documents attend across", fix_acts="forward")

AS_REPORTED = packing_case("field_transformers_46634_as_reported", gate_on_mask=True)
FIXED = packing_case("field_transformers_46634_fixed")


def train_step(model, optimizer, batch):
    input_ids, position_ids, labels = stream(*batch)
    return token_mean_step(model, optimizer, input_ids, position_ids, labels, torch.ones_like(input_ids))


def buggy():
    return ec.check_step(AS_REPORTED, train_step)


def fixed():
    return ec.check_step(FIXED, train_step)
