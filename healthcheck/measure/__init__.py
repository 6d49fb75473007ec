"""Measuring a worker: the collectives (:mod:`.distributed`), the DDP hook (:mod:`.monitor`) with its
sketch (:mod:`.count_sketch`) and exact pass (:mod:`.exact_pass`), the pure per-step math
(:mod:`.metrics`), the per-step rows (:mod:`.records`) and the audit evidence (:mod:`.evidence`)."""
