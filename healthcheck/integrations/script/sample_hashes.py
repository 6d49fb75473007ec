"""A 63-bit hash of each sample in a batch a DataLoader yields, for the shard audit where indices say nothing.

An ``IterableDataset`` (a streaming pipeline that shards itself by rank) is fetched without indices, and a per-rank
split (``datasets.distributed.split_dataset_by_node``) gives every rank the indices 0..n of its own part. Both are
the usual way to feed a large run, and a rank reading the wrong part is the first fault this tool exists for. What
the ranks can still compare is what they trained on: each sample's tokens.

A sample is a row of the batch's main tensor: ``input_ids`` in a mapping, else the first tensor (of a mapping, a
tuple or a list), or the batch itself. Its padding depends on the batch it landed in (a collate pads to the longest
sample), so where the batch has a mask of the same shape (``attention_mask``, or a later 0/1 tensor of a tuple) only
the tokens it keeps are hashed: the same sample then hashes alike in any batch. Without a mask a row is hashed whole,
so a sample padded otherwise in another batch is not matched (an overlap missed, never one made up). A tensor off
the CPU is not read: that would make every fetch wait for the device.

    >>> import torch
    >>> ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    >>> mask = (ids != 0).long()
    >>> a = sample_hashes({"input_ids": ids, "attention_mask": mask})
    >>> b = sample_hashes((torch.tensor([[8, 9]]), torch.tensor([[1, 1]])))  # the second sample, in a batch of its own
    >>> len(a), a[1] == b[0], a[0] != a[1]
    (2, True, True)
    >>> sample_hashes(["a string", "no tensor"]) is None
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Optional

#: Bytes of a sample hashed at most: a sample's first 8,192 int64 tokens. Longer samples (a packed 32k-token
#: sequence, an image) differ within them all the same, and a fetch stays cheap whatever the batch holds.
_MAX_BYTES = 65_536


def sample_hashes(batch: Any) -> Optional[list[int]]:
    """One hash per sample of ``batch`` (see the module's docstring), or None where it holds no CPU tensor to read."""
    tensors = _tensors(batch)
    if not tensors or not _is_cpu_tensor(tensors[0]) or tensors[0].dim() == 0:
        return None
    import torch

    main = tensors[0]
    # A mask marks a sequence's positions: a batch of single values (class labels beside them) has none.
    mask = next((t for t in tensors[1:] if _is_mask_of(t, main)), None) if main.dim() > 1 else None
    out = []
    for row in range(main.shape[0]):
        kept = main[row] if mask is None else main[row][mask[row].bool()]
        data = kept.contiguous().reshape(-1).view(torch.uint8)[:_MAX_BYTES].numpy().tobytes()
        digest = hashlib.blake2b(str(kept.dtype).encode() + data, digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)  # 63 bits: a JSON number every reader keeps exactly
    return out


def _tensors(batch: Any) -> list[Any]:
    """The batch's tensors, the main one first: ``input_ids`` (then ``attention_mask``) of a mapping, else in order."""
    if _is_tensor(batch):
        return [batch]
    if isinstance(batch, Mapping):
        keys = [k for k in ("input_ids", "attention_mask") if k in batch] + [k for k in batch if k not in ("input_ids", "attention_mask")]
        return [batch[k] for k in keys if _is_tensor(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [item for item in batch if _is_tensor(item)]
    return []


def _is_mask_of(candidate: Any, main: Any) -> bool:
    """A tensor of main's shape holding only 0 and 1 (or booleans): which of main's positions are real tokens."""
    if tuple(candidate.shape) != tuple(main.shape) or not _is_cpu_tensor(candidate) or candidate.is_floating_point():
        return False
    return bool(((candidate == 0) | (candidate == 1)).all())


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_cpu_tensor(value: Any) -> bool:
    return value.device.type == "cpu"

