"""Probing a user's own training script, unmodified: the patches that see it (:mod:`.patches`), what it
reveals (:mod:`.observe`, :mod:`.loaders`) and the session that turns its optimizer steps into probe steps (:mod:`.session`)."""
