"""Running a probe: the launcher (:mod:`.probe`, :mod:`.launcher`, :mod:`.watchdog`, :mod:`.failures`),
the worker and its training step (:mod:`.worker`, :mod:`.trainer`, :mod:`.data`, :mod:`.modeling`,
:mod:`.faults`, :mod:`.progress`), and probes of probes (:mod:`.recording`, :mod:`.scenarios`)."""
