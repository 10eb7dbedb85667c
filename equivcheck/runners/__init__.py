"""One run: here, in a forked child (``isolation``), or on ranks (``ranks``); evaluations beside training runs."""
