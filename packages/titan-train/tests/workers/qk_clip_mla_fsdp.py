"""torchrun worker (2 ranks, gloo) for test_qk_clip_mla.py: QK-clip on a tiny deepseek_v3 under FSDP, each
rank its own tokens; the peaks before and after are recomputed from the whole weights over both ranks' inputs
(`mla_logits`), for wq (q_lora_rank 0) and wq_a/wq_b (12)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests folder: mla_logits
from mla_logits import peak_logits, tiny_mla, whole_weights  # noqa: E402

from titan_parallel import clip_latent_query_key  # noqa: E402


def case(q_lora_rank: int) -> dict:
    model = tiny_mla(q_lora_rank)
    args, rank = model.args, dist.get_rank()
    before = {n: whole_weights(b.attention) for n, b in model.layers.items()}
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    inputs = {}
    for name, block in model.layers.items():
        block.attention.register_forward_pre_hook(
            lambda m, a, name=name: inputs.update({name: a[0].detach()})
        )
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(10 + rank))
    model.record_max_logits(True)
    model(tokens).sum().backward()
    table = model.freqs_cis
    xs = {}
    for name, x in inputs.items():
        both = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(both, x.contiguous())
        xs[name] = both
    peaks = torch.cat([peak_logits(before[n], xs[n], table, args) for n in model.layers])
    by_rank = [
        torch.cat([peak_logits(before[n], [xs[n][r]], table, args) for n in model.layers]) for r in (0, 1)
    ]
    tau = peaks.sort().values[3:5].mean().item()  # between the 4th and 5th of 8 heads: 4 above, 4 under
    clipped = clip_latent_query_key(model, tau, dist.group.WORLD)
    after = {n: whole_weights(b.attention) for n, b in model.layers.items()}
    got = torch.cat([peak_logits(after[n], xs[n], table, args) for n in model.layers])
    expected = torch.where(peaks > tau, torch.full_like(peaks, tau), peaks)
    heads = args.n_heads
    return {
        "difference": ((got - expected).abs() / expected.abs()).max().item(),
        "above_tau": int((peaks > tau).sum()),
        "under_tau": int((peaks < tau).sum()),
        "peaks_only_on_rank_1": int((by_rank[1] > by_rank[0]).sum()),
        "heads_above_tau": [int(i) for i in (peaks > tau).nonzero().flatten()],
        "clipped_heads": [int(name.split(".")[1]) * heads + h for name, h, _ in clipped],
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    results = {str(rank): case(rank) for rank in (0, 12)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
