"""The script section: the user's own training script or module, probed instead of the built-in trainer."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from healthcheck.config.section import Section


class ScriptConfig(Section):
    """The user's own training script, probed instead of the built-in trainer (``healthcheck probe --script``)."""

    path: Optional[str] = Field(
        None,
        description="The training script, run unmodified as __main__ on every worker (as `python PATH` runs it); "
        "relative to the working directory. Give this or module.",
    )
    module: Optional[str] = Field(
        None,
        description="Or the training module, run as `python -m MODULE` runs it, the working directory first on "
        "sys.path (torchtitan's torchtitan.train, nanochat's scripts.base_train).",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
    )
    args: list[str] = Field(
        default_factory=list,
        description="The script's arguments (its sys.argv[1:]). The text {seed} in an argument is replaced by "
        "train.seed, so the seeds of `baseline record` reach the script.",
    )

    @model_validator(mode="after")
    def _one_target(self) -> "ScriptConfig":
        if (self.path is None) == (self.module is None):
            raise ValueError("give the script's path or its module (script.path or script.module), one of them")
        return self

    @property
    def target(self) -> str:
        """What is probed, as the command line names it: ``train.py`` or ``-m pkg.train``."""
        return self.path if self.path is not None else f"-m {self.module}"

    def argv(self, seed: int) -> list[str]:
        """``sys.argv`` for the script: its path (a module's name, which ``runpy`` replaces with its file, as
        ``python -m`` does), then its arguments with ``{seed}`` filled in.

        >>> ScriptConfig(path="train.py", args=["--seed", "{seed}", "--lr=1e-4"]).argv(7)
        ['train.py', '--seed', '7', '--lr=1e-4']
        >>> ScriptConfig(module="scripts.base_train").target
        '-m scripts.base_train'
        """
        return [self.path or str(self.module), *(arg.replace("{seed}", str(seed)) for arg in self.args)]
