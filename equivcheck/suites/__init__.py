"""Fixed collections of checks: the audit of a case, the pitfall catalogue, the field of reported bugs."""
