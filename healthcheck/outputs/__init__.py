"""What a run reports: the terminal (:mod:`.terminal`), Markdown (:mod:`.markdown`), plots (:mod:`.plots`),
JUnit and annotations (:mod:`.ci_outputs`), OpenMetrics (:mod:`.openmetrics`), all written by
:mod:`.report`."""
