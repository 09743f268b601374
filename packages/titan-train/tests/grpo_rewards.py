"""Reward functions of the GRPO tests, importable by name (`grpo_rewards:vowel_share`): continuous values, so
every group's rewards differ, and an abstention (None) on rows without a `hint` column value."""


def _text(completion):
    return completion if isinstance(completion, str) else completion[0]["content"]


def vowel_share(completions, **_):
    """The share of the completion's letters that are vowels."""
    out = []
    for c in completions:
        letters = [ch for ch in _text(c).lower() if ch.isalpha()]
        out.append(sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0)
    return out


def hint_length(completions, completion_ids, hint=None, **_):
    """-|completion tokens - hint| / 10, None where the row has no hint (or no row has a `hint` column)."""
    hint = hint or [None] * len(completion_ids)
    return [
        None if h is None else -abs(len(ids) - h) / 10 for ids, h in zip(completion_ids, hint, strict=True)
    ]


_calls = {"n": 0}


def vowel_share_or_die(completions, **kw):
    """vowel_share; SIGKILLs its own process at the TITAN_TEST_DIE_AT-th call (a rank lost mid-step, after
    its rollouts were generated and before it trained on them)."""
    import os
    import signal

    _calls["n"] += 1
    if os.environ.get("TITAN_TEST_DIE_AT") == str(_calls["n"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return vowel_share(completions, **kw)
