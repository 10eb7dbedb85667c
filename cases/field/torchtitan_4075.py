"""pytorch/torchtitan#4075: in packed pre-training a document's last token learnt the next document's first.

torchtitan's text dataset concatenates documents into one token buffer and cuts ``x`` from it: ``input = x[:-1]``,
``label = x[1:]``, so the label of each document's last token is the first token of the next, unrelated one
(harmless only while BOS and EOS always separate documents). The merged pull sets the label at each document's end
to the ignore index. The row: a team's step packs each global batch's documents whole into rows, labels shifted over
the stream as reported, or masked at each document's end as fixed; a block-diagonal mask from ``position_ids`` keeps
attention within documents; held to the same model on the documents padded one a row.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import packing_case, stream, token_mean_step

BUG = Bug("pytorch/torchtitan", "pull", 4075, "packing",
          "labels x[1:] over the packed buffer: each document's last token learnt the next one's first",
          fix_acts="loss")

CASE = packing_case("field_torchtitan_4075")


def train_step_as_reported(model, optimizer, batch):
    return token_mean_step(model, optimizer, *stream(*batch, label_across=True))


def train_step(model, optimizer, batch):
    return token_mean_step(model, optimizer, *stream(*batch))


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
