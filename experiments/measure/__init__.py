"""What a run measures: one timer (`timing`), one FLOP counter (`flops`), the quality metrics (`metrics`), the
image features they compare (`features`), the quality of image sets on disk (`image_sets`), and the one table
of result columns (`columns`)."""
