"""How one rank resolves its own config: the seed policy first, then its explicit ``rank_overrides`` entry."""

from __future__ import annotations

from healthcheck.config.schema import RANK0_SEED_OFFSET, ProbeConfig, deep_merge


def effective_seed(config: ProbeConfig, rank: int) -> int:
    """This rank's seed under ``seed_policy`` (before any explicit rank override)."""
    if config.seed_policy == "rank0_differs" and rank == 0:
        return config.train.seed + RANK0_SEED_OFFSET
    if config.seed_policy == "per_rank":
        return config.train.seed + rank
    return config.train.seed


def resolve_for_rank(config: ProbeConfig, rank: int) -> ProbeConfig:
    """The config this rank actually trains with: seed policy first, then its explicit override.

    >>> c = ProbeConfig(seed_policy="per_rank")
    >>> resolve_for_rank(c, 3).train.seed
    45
    >>> resolve_for_rank(ProbeConfig(rank_overrides={0: {"train": {"lr": 0.01}}}), 0).train.lr
    0.01
    """
    data = config.model_dump(exclude={"rank_overrides"})
    data["train"]["seed"] = effective_seed(config, rank)
    data = deep_merge(data, config.rank_overrides.get(rank, {}))
    resolved = ProbeConfig.model_validate(data)
    if resolved.train.data_seed is None:
        resolved.train.data_seed = resolved.train.seed
    return resolved
