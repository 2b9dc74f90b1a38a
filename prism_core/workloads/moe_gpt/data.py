"""The synthetic dataset and Megatron's data path.

Samples are arithmetic token sequences (start and stride drawn per sample from a seeded
generator, wrapping at the vocabulary size), so next-token loss can fall quickly. Sample i of
step t for data-parallel rank d, microbatch m, row j is global index
t·GBS + d·(M·mbs) + m·mbs + j: any layout sees the same global batch.
Data path as in Megatron: rank 0 broadcasts the dataloader status to the world once; on the
first and last pipeline stages the tensor-parallel source rank (tp index 0) builds each
microbatch and broadcasts token ids and labels to its TP group.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

MAX_STRIDE = 7


def sample(seed: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:sample:{index}".encode()))
    start = int(torch.randint(vocab_size, (1,), generator=gen))
    stride = int(torch.randint(1, MAX_STRIDE + 1, (1,), generator=gen))
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


class DataPath:
    def __init__(self, cfg, state):
        self.cfg, self.state = cfg, state
        m, p = cfg.model, cfg.parallel
        self.mbs, self.seq, self.vocab = m.micro_batch_size, m.seq_length, m.vocab_size
        self.per_dp = p.microbatches * m.micro_batch_size
        self.global_batch = self.per_dp * state.topo.dp
        c = state.coord
        self.tp_src = state.topo.rank_of(0, c.dp, c.pp)

    def broadcast_status(self) -> None:
        """Rank 0 tells everyone which dataloaders exist (train / valid / test), as Megatron does."""
        flags = torch.tensor([1, 0, 0], dtype=torch.long) if self.state.rank == 0 else torch.zeros(3, dtype=torch.long)
        dist.broadcast(flags, src=0)
        if int(flags[0]) != 1:
            raise RuntimeError("dataloader status broadcast from rank 0 says there is no training data")

    def batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and labels, [mbs, seq] each, of microbatch `mb` of training step `step`."""
        both = torch.empty(2, self.mbs, self.seq, dtype=torch.long)
        if self.state.coord.tp == 0:
            base = step * self.global_batch + self.state.coord.dp * self.per_dp + mb * self.mbs
            rows = torch.stack([sample(self.cfg.job.seed, base + j, self.seq, self.vocab) for j in range(self.mbs)])
            both[0], both[1] = rows[:, :-1], rows[:, 1:]
        tp_group = self.state.group("tp")
        if tp_group is not None:
            dist.broadcast(both, src=self.tp_src, group=tp_group)
        return both[0], both[1]
