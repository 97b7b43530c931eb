"""Output formats written from a merged store (the HTML report, ...)."""
