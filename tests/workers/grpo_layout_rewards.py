"""The reward of the GRPO layout rows (tests/test_train_layouts.py), importable by the worker as
`grpo_layout_rewards:low_id_share` (this folder is on its sys.path): continuous in the completion's ids, so
every group's two rewards differ and the batch's spread moves each advantage."""


def low_id_share(completion_ids, **_):
    """The share of the completion's token ids below 1000 (of the bundled tokenizer's 2048)."""
    return [sum(i < 1000 for i in ids) / len(ids) if ids else 0.0 for ids in completion_ids]
