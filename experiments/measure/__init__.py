"""What a run measures: one timer (`timing`), one FLOP counter (`flops`), quality metrics and feature
extractors (`metrics`)."""
