"""What a run measures beside its numbers: peak activation memory and gradient communication."""
