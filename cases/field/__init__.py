"""The field: publicly reported training bugs, one module each, run by ``equivcheck field`` (equivcheck/suites/field.py).

Each module cites its report, reproduces the code as it was and as it was fixed on a tiny model, and checks
both through equivcheck's public API. The modules register their cases when imported; this package imports none
of them, so the built-in matrix stays as it is.
"""
