"""What a run reports: the terminal (:mod:`.terminal`), the self-contained page (:mod:`.html`, charts in
:mod:`.charts`), Markdown (:mod:`.markdown`, Mermaid charts for the CI summary in :mod:`.mermaid`), plots
(:mod:`.plots`), JUnit and annotations (:mod:`.ci_outputs`), OpenMetrics (:mod:`.openmetrics`), all
written by :mod:`.report`."""
