"""Measuring a worker: the collectives (:mod:`.distributed`), the DDP hook (:mod:`.monitor`) with its
sketch (:mod:`.sketch`) and exact pass (:mod:`.exact_pass`), the one gather per step
(:mod:`.step_gather`), the pure per-step math (:mod:`.metrics`), the per-step rows
(:mod:`.records`), the audit evidence (:mod:`.evidence`) and the environment (:mod:`.environment`)."""
