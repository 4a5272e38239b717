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
    assert len(h1) == 1 and len(h2) == 3  # the system prompt has no hash of its own
    assert h2[:1] == h1


def test_conversations_that_share_only_a_system_prompt_share_no_hash():
    """So they spread over replicas instead of all following the system prompt."""
    a = prefix_hashes([SYSTEM, {"role": "user", "content": "a"}], "")
    b = prefix_hashes([SYSTEM, {"role": "user", "content": "b"}], "")
    assert len(a) == len(b) == 1 and a[0] != b[0]
    # The system prompt is still part of the hash: another one makes another conversation.
    other = {"role": "system", "content": "You are verbose."}
    assert prefix_hashes([other, {"role": "user", "content": "a"}], "") != a
    # The role counts: the same text from another role is another block.
    c = prefix_hashes([{"role": "user", "content": "You are terse."}], "")
    d = prefix_hashes([{"role": "assistant", "content": "You are terse."}], "")
    assert c != d
    # A prompt of system messages only still has a hash.
    assert len(prefix_hashes([SYSTEM, other], "")) == 1


def test_raw_prompts_are_cut_into_blocks():
    text = "x" * (PROMPT_BLOCK * 2 + 10)
    hashes = prefix_hashes([], text)
    assert len(hashes) == 3
    assert prefix_hashes([], text[: PROMPT_BLOCK * 2]) == hashes[:2]
    assert prefix_hashes([], "") == []
    # A lone surrogate (invalid UTF-8) is hashed, not an error.
    assert len(prefix_hashes([{"role": "user", "content": "\ud800"}], "")) == 1
