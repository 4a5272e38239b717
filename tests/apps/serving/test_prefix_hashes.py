"""Prefix hashes: a conversation that resends its history shares every earlier hash."""

from __future__ import annotations

from apps.serving.balancer import PROMPT_BLOCK, prefix_hashes

SYSTEM = {"role": "system", "content": "You are terse."}


def test_a_follow_up_turn_extends_the_chain_of_the_turn_before():
    turn1 = [SYSTEM, {"role": "user", "content": "Hi"}]
    turn2 = turn1 + [
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    h1, h2 = prefix_hashes(turn1, ""), prefix_hashes(turn2, "")
    assert len(h1) == 2 and len(h2) == 4
    assert h2[:2] == h1


def test_a_shared_system_prompt_shares_the_first_hash_only():
    a = prefix_hashes([SYSTEM, {"role": "user", "content": "a"}], "")
    b = prefix_hashes([SYSTEM, {"role": "user", "content": "b"}], "")
    assert a[0] == b[0] and a[1] != b[1]
    # The role counts: the same text from another role is another block.
    c = prefix_hashes([{"role": "user", "content": "You are terse."}], "")
    assert c[0] != a[0]


def test_raw_prompts_are_cut_into_blocks():
    text = "x" * (PROMPT_BLOCK * 2 + 10)
    hashes = prefix_hashes([], text)
    assert len(hashes) == 3
    assert prefix_hashes([], text[: PROMPT_BLOCK * 2]) == hashes[:2]
    assert prefix_hashes([], "") == []
    # A lone surrogate (invalid UTF-8) is hashed, not an error.
    assert len(prefix_hashes([{"role": "user", "content": "\ud800"}], "")) == 1
