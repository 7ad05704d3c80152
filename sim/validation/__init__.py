"""The simulator against published and measured figures (``pdlb sim validate``)."""
