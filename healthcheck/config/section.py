"""The base of every config section: unknown keys are errors, and assignments are validated too."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A typed config section (``extra="forbid"``: a misspelt key is an error naming it, not a silent default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
