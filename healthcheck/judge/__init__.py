"""Judging a finished run: the window summary (:mod:`.summary`), who stands out (:mod:`.attribution`),
the audits (:mod:`.assemble` feeding :mod:`.shard_audit`, :mod:`.exact_audits`, :mod:`.rank_outliers`,
:mod:`.spikes`), the envelopes and baselines (:mod:`.envelope`, :mod:`.baseline`) and the verdict
(:mod:`.findings`, :mod:`.verdict`)."""
