"""The continuous-batching engine against llama-cpp-python's own Llama, same process.

`engine` runs the default throughput mode (one KV cache, mixed batches, prompt cache);
`invariant` the batch-invariant mode, whose greedy texts must equal solo runs.
"""

from __future__ import annotations

import pytest

from tests.conftest import CHAT, OWLS, TRAINS
from workers.engine import errors as codes
from workers.engine.core import BatchEngine, HostCache, Request, Room, Sampling, common_prefix
from workers.engine.errors import EngineError
from workers.engine.events import Batch, Done, Token


@pytest.fixture(scope="module")
def engine(smollm2_path):
    e = BatchEngine(str(smollm2_path), context_length=512, parallel=4, threads=2, max_queue=8)
    yield e
    e.close()


@pytest.fixture(scope="module")
def invariant(smollm2_path):
    e = BatchEngine(
        str(smollm2_path), context_length=512, parallel=4, threads=2, batch_invariant=True
    )
    yield e
    e.close()


def free_slots(engine) -> int:
    return sum(not slot.busy for slot in engine.slots)


def chat_tokens(engine, messages=CHAT, template=None):
    """The prompt's tokens under the file's chat template, or `template`."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    fmt = Jinja2ChatFormatter(
        template=template or engine.meta("tokenizer.chat_template"),
        eos_token=engine.eos_text(),
        bos_token=engine.bos_text(),
    )
    return engine.tokenize(fmt(messages=messages).prompt, add_bos=False, special=True)


def run(engine, requests, cancel_after=None, collect_logprobs=False):
    """Step until idle; returns texts and done events by request id (with collect_logprobs,
    also each request's logprob entries)."""
    texts, done, errors, logprobs = {}, {}, {}, {}
    for r in requests:
        engine.submit(r)
    steps = 0
    while not engine.idle():
        for ev in engine.step():
            if isinstance(ev, Token):
                texts[ev.id] = texts.get(ev.id, "") + ev.text
                logprobs.setdefault(ev.id, []).extend(ev.logprobs)
            elif isinstance(ev, Done):
                done[ev.id] = ev
            else:
                errors[ev.id] = ev
        steps += 1
        if cancel_after and steps == cancel_after[1]:
            for ev in engine.cancel(cancel_after[0]):
                done[ev.id] = ev
    if collect_logprobs:
        return texts, done, errors, {k: logprobs.get(k, []) for k in done}
    return texts, done, errors


def gemma_turn(engine, text):
    """One user turn in the chat template the stack gives gemma (the catalog's: its file
    has none)."""
    from apps.catalog.sources import GEMMA_CHAT_TEMPLATE

    return chat_tokens(engine, [{"role": "user", "content": text}], GEMMA_CHAT_TEMPLATE)


GREEDY = Sampling(temperature=0)


def data(n):
    """A host-RAM buffer of n bytes, as the engine's saves make them (HostCache tests)."""
    import ctypes

    return (ctypes.c_uint8 * n)()


#: Story subjects for tests that run many prompts at once.
STORY_TOPICS = [
    "a dragon who learns to sail",
    "a lighthouse keeper and a storm",
    "a robot that paints the sea",
    "a city under the ice",
    "the last train of the night",
    "a garden on the moon",
    "a clock that runs backwards",
    "a cat who runs a bakery",
    "a map of forgotten islands",
    "a violin found in an attic",
]
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List two fruits."}],
    [{"role": "user", "content": "Say hello."}],
]


@pytest.mark.parametrize("mode", ["engine", "invariant"])
def test_greedy_text_equals_llama_in_process(mode, request, reference_text):
    engine = request.getfixturevalue(mode)
    req = Request("a", chat_tokens(engine), 48, GREEDY, cache_prompt=False)
    texts, done, _ = run(engine, [req])
    assert texts["a"] == reference_text(CHAT, 48)
    assert done["a"].reason in ("stop", "length")
    assert done["a"].usage["prompt_tokens"] == len(chat_tokens(engine))


def test_the_thread_count_changes_between_steps_and_the_text_does_not(invariant, reference_text):
    """The agent moves threads between engines as they get busy (service._share_cores):
    llama.cpp takes the new count at the next decode, and a greedy text is the same."""
    engine = invariant
    try:
        engine.set_threads(1)
        assert engine.decode_threads() == 1
        req = Request("t1", chat_tokens(engine), 48, GREEDY)
        engine.submit(req)
        texts = ""
        while not engine.idle():
            for ev in engine.step():
                if isinstance(ev, Token):
                    texts += ev.text
                    engine.set_threads(3 - engine.decode_threads())  # 1, 2, 1, ... mid-run
        assert texts == reference_text(CHAT, 48)
    finally:
        engine.set_threads(2)
    assert engine.decode_threads() == 2


def test_concurrent_sequences_each_equal_their_solo_run(invariant, reference_text):
    # More requests than slots: the extra ones wait and join between steps.
    engine = invariant
    reqs = [Request(f"r{i}", chat_tokens(engine, p), 40, GREEDY) for i, p in enumerate(PROMPTS)]
    texts, done, errors = run(engine, reqs)
    assert not errors
    for i, p in enumerate(PROMPTS):
        assert texts[f"r{i}"] == reference_text(p, 40), p
    assert free_slots(engine) == engine.parallel  # every slot came back


def test_presence_and_frequency_penalties_match_llama_in_process(invariant, reference_llama):
    """OpenAI's two penalties go to llama.cpp's penalties sampler as llama-cpp-python's Llama
    sends them (the last 64 generated tokens): the same greedy text, and not the text
    without them."""
    engine = invariant
    messages = [{"role": "user", "content": "Repeat the word 'owl' twenty times."}]
    penalized = Sampling(temperature=0, presence_penalty=0.5, frequency_penalty=1.5)
    reqs = [
        Request("plain", chat_tokens(engine, messages), 40, GREEDY),
        Request("penalized", chat_tokens(engine, messages), 40, penalized),
    ]
    texts, _, errors = run(engine, reqs)
    assert not errors
    ref = reference_llama.create_chat_completion(
        messages, temperature=0, max_tokens=40, presence_penalty=0.5, frequency_penalty=1.5
    )["choices"][0]["message"]["content"]
    assert texts["penalized"] == ref
    assert texts["penalized"] != texts["plain"]


def test_a_request_whose_sampler_fails_fails_alone(engine, monkeypatch, reference_text):
    """A request whose sampler cannot be made (a wrong ctypes call once took the whole engine
    process down for any repeat_penalty) ends with an error; the requests beside it go on."""
    made = engine._new_sampler

    def new_sampler(s: Sampling):
        if s.seed == 666:
            raise TypeError("this function takes at least 5 arguments (4 given)")
        return made(s)

    monkeypatch.setattr(engine, "_new_sampler", new_sampler)
    bad = Request("bad", chat_tokens(engine), 8, Sampling(temperature=0.7, seed=666))
    good = Request("good", chat_tokens(engine), 8, GREEDY)
    texts, done, errors = run(engine, [bad, good])
    assert list(errors) == ["bad"] and "sampler" in errors["bad"].message
    assert errors["bad"].code == codes.UNSPECIFIED  # the engine's fault: not a 400
    assert texts["good"] == reference_text(CHAT, 8) and done["good"].reason in ("stop", "length")
    assert free_slots(engine) == engine.parallel


def test_max_tokens_ends_with_length(engine):
    tokens = chat_tokens(engine, [{"role": "user", "content": "Write a long story."}])
    _, done, _ = run(engine, [Request("x", tokens, 5, GREEDY)])
    assert done["x"].reason == "length"
    assert done["x"].usage["completion_tokens"] == 5


def test_stop_string_is_cut_and_not_returned(engine, reference_text):
    full = reference_text(CHAT, 48)  # "The capital of France is Paris."
    texts, done, _ = run(engine, [Request("s", chat_tokens(engine), 48, GREEDY, stop=[" is"])])
    assert texts.get("s", "") == full.split(" is")[0]
    assert done["s"].reason == "stop"


def test_prompt_over_context_is_refused_clearly(engine):
    with pytest.raises(EngineError) as err:
        engine.submit(Request("big", [1] * 600, 10, GREEDY))
    assert err.value.code == codes.CONTEXT_LENGTH_EXCEEDED
    assert "600 tokens" in err.value.message and "512" in err.value.message


def test_generation_stops_at_the_end_of_its_context(smollm2_path):
    e = BatchEngine(str(smollm2_path), context_length=64, parallel=1, threads=2)
    try:
        tokens = chat_tokens(e, [{"role": "user", "content": "Write a very long story."}])
        _, done, _ = run(e, [Request("c", tokens, 0, GREEDY)])
        assert done["c"].reason == "length"
        assert done["c"].usage["prompt_tokens"] + done["c"].usage["completion_tokens"] == 64
    finally:
        e.close()


def test_cancel_frees_the_slot_and_others_continue(invariant, reference_text):
    engine = invariant
    long = chat_tokens(engine, [{"role": "user", "content": "Write a long story."}])
    reqs = [Request("long", long, 200, GREEDY), Request("short", chat_tokens(engine), 48, GREEDY)]
    texts, done, _ = run(engine, reqs, cancel_after=("long", 5))
    assert done["long"].reason == "cancelled"
    assert done["long"].usage["completion_tokens"] < 10
    assert texts["short"] == reference_text(CHAT, 48)
    assert free_slots(engine) == engine.parallel


def test_full_queue_is_refused(smollm2_path):
    e = BatchEngine(str(smollm2_path), context_length=128, parallel=1, threads=2, max_queue=2)
    try:
        e.submit(Request("1", [1, 2, 3], 1, GREEDY))
        e.submit(Request("2", [1, 2, 3], 1, GREEDY))
        with pytest.raises(EngineError) as err:
            e.submit(Request("3", [1, 2, 3], 1, GREEDY))
        assert err.value.code == codes.OVERLOADED
    finally:
        e.close()


def test_seeded_sampling_is_reproducible(engine):
    s = Sampling(temperature=0.9, seed=1234)
    a, _, _ = run(engine, [Request("a", chat_tokens(engine), 24, s)])
    b, _, _ = run(engine, [Request("b", chat_tokens(engine), 24, s)])
    assert a["a"] == b["b"]
    assert a["a"]


def test_corrupt_file_raises_a_clear_error(tmp_path, smollm2_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(smollm2_path.read_bytes()[:200_000])
    with pytest.raises(EngineError) as err:
        BatchEngine(str(bad), 128, 1, 2)
    assert err.value.code == codes.BAD_MODEL_FILE


def _events(engine, req):
    """Token events and the done event of one request run alone."""
    engine.submit(req)
    pieces, done = [], None
    while not engine.idle():
        for ev in engine.step():
            if isinstance(ev, Token):
                pieces.append(ev)
            elif isinstance(ev, Done):
                done = ev
    return pieces, done


STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.mark.parametrize("cut", [1, 7, 20, 45])
def test_resumed_generation_continues_the_text_exactly(invariant, cut):
    """Migration: another engine given the tokens so far continues with the same text."""
    engine = invariant
    prompt = chat_tokens(engine, STORY)
    full, full_done = _events(engine, Request("whole", prompt, 64, GREEDY))
    text = "".join(p.text for p in full)
    ids = [t for p in full[:cut] for t in p.token_ids]
    delivered = "".join(p.text for p in full[:cut])
    rest, done = _events(
        engine,
        Request(
            "resumed",
            prompt,
            64,
            GREEDY,
            resume_tokens=ids,
            delivered_bytes=len(delivered.encode()),
        ),
    )
    assert delivered + "".join(p.text for p in rest) == text
    assert done.usage == full_done.usage  # same usage: resumed tokens count as generated
    assert done.reason == full_done.reason


def test_resumed_generation_resends_text_held_back_for_a_stop_string(engine):
    """Tokens whose text was held back (it may begin a stop string) are not lost."""
    prompt = chat_tokens(engine, STORY)
    whole, _ = _events(engine, Request("w", prompt, 40, GREEDY))
    text = "".join(p.text for p in whole)
    ids = [t for p in whole for t in p.token_ids]
    # The client got only the first half of the text, though every token was sent.
    delivered = text[: len(text) // 2]
    rest, done = _events(
        engine,
        Request(
            "r",
            prompt,
            40,
            GREEDY,
            resume_tokens=ids,
            delivered_bytes=len(delivered.encode()),
        ),
    )
    assert delivered + "".join(p.text for p in rest) == text
    assert done.reason == "length" and done.usage["completion_tokens"] == 40


def test_text_does_not_depend_on_what_runs_beside_it(smollm2_path, reference_text):
    """More prompts than slots, joining while others decode: every text is its solo text."""
    prompts = [
        [{"role": "user", "content": f"Write a long story about {t}.{extra}"}]
        for extra in ("", " Make it funny.")
        for t in STORY_TOPICS
    ]
    e = BatchEngine(
        str(smollm2_path), context_length=2048, parallel=8, threads=2, batch_invariant=True
    )
    try:
        reqs = [Request(f"p{i}", chat_tokens(e, p), 64, GREEDY) for i, p in enumerate(prompts)]
        texts, _, errors = run(e, reqs)
    finally:
        e.close()
    assert not errors
    diverged = [i for i, p in enumerate(prompts) if texts[f"p{i}"] != reference_text(p, 64)]
    assert diverged == []


def test_invariant_texts_equal_solo_runs_on_a_model_whose_kernels_depend_on_batch_rows(
    gemma_path,
):
    """gemma-3-270m's weight types go through CPU kernels that sum differently for 8 or
    more rows than for fewer: with one llama_decode for all 8 slots, 2 of these 16 stories
    differed from their solo texts. Solo texts come from the same engine, one at a time."""
    prompts = [
        f"Write a long story about {t}.{x}"
        for x in ("", " Make it funny.")
        for t in STORY_TOPICS[:8]
    ]
    e = BatchEngine(
        str(gemma_path), context_length=256, parallel=8, threads=2, batch_invariant=True
    )
    try:

        def requests():
            return [
                Request(f"p{i}", e.tokenize(p, add_bos=True, special=False), 64, GREEDY)
                for i, p in enumerate(prompts)
            ]

        solo = {}
        for r in requests():
            solo.update(run(e, [r])[0])
        together, _, errors = run(e, requests())
    finally:
        e.close()
    assert not errors and len(solo) == len(prompts)
    assert [k for k in solo if together[k] != solo[k]] == []


def test_outbox_sends_the_first_piece_at_once_and_merges_the_rest():
    import time

    from workers.engine.process import Outbox

    class Pipe(list):
        send = list.append

    pipe = Pipe()
    out = Outbox(pipe, interval=60.0)  # nothing waits long enough during this test
    out.send(Token("a", "Hel", 0, [1], 9, []))
    out.tick()
    out.send(Token("a", "lo", 1, [2], 9, ["lp2"]))
    out.send(Token("a", " you", 2, [3, 4], 9, ["lp3", "lp4"]))
    out.tick()
    assert pipe == [Token("a", "Hel", 0, [1], 9, [])]
    out.send(Done("a", "stop", {}, {}))
    out.tick()
    # The held text and the end leave in one message.
    assert pipe[1:] == [
        Batch(
            [
                Token("a", "lo you", 1, [2, 3, 4], 9, ["lp2", "lp3", "lp4"]),
                Done("a", "stop", {}, {}),
            ]
        )
    ]
    fast = Outbox(pipe := Pipe(), interval=0.0)  # 0: one piece per token, one send a step
    for i, text in enumerate("abc"):
        fast.send(Token("b", text, i, [i], 1, []))
        fast.tick()
    assert [m.text for m in pipe] == ["a", "b", "c"]
    slow = Outbox(pipe := Pipe(), interval=0.01)
    slow.send(Token("c", "x", 0, [1], 1, []))
    slow.tick()
    slow.send(Token("c", "y", 1, [2], 1, []))
    slow.tick()
    time.sleep(0.02)
    slow.tick()  # waited long enough: sent without a new piece arriving
    assert [(m.text, m.index) for m in pipe] == [("x", 0), ("y", 1)]
    # Two streams' first pieces of one step: one message.
    both = Outbox(pipe := Pipe(), interval=60.0)
    both.send(Token("d", "1", 0, [1], 1, []))
    both.send(Token("e", "2", 0, [2], 1, []))
    both.tick()
    assert pipe == [Batch([Token("d", "1", 0, [1], 1, []), Token("e", "2", 0, [2], 1, [])])]


def test_outbox_holds_pieces_longer_the_more_streams_are_in_flight():
    from workers.engine.process import MAX_HOLD, Outbox

    class Pipe(list):
        send = list.append

    now = [0.0]
    out = Outbox(pipe := Pipe(), interval=0.02, clock=lambda: now[0])
    out.send(Token("a", "x", 0, [1], 1, []))
    out.tick()
    assert out.hold() == 0.02  # one stream: the interval itself
    now[0] = 0.03
    out.send(Token("a", "y", 1, [2], 1, []))
    out.tick()
    assert [m.text for m in pipe] == ["x", "y"]
    for rid in "bcd":  # three more streams: their first pieces go at once
        out.send(Token(rid, rid, 0, [1], 1, []))
    out.tick()
    assert out.hold() == 0.08
    now[0] = 0.09  # 60 ms after a's last piece: within the four streams' 80 ms
    out.send(Token("a", "z", 2, [3], 1, []))
    out.tick()
    assert pipe[-1] == Batch([Token(r, r, 0, [1], 1, []) for r in "bcd"])
    now[0] = 0.111
    out.tick()
    assert pipe[-1] == Token("a", "z", 2, [3], 1, [])
    for rid in "efghijkl":
        out.send(Token(rid, rid, 0, [1], 1, []))
    assert out.hold() == MAX_HOLD  # twelve streams: capped
    for rid in "abcdefghijkl":
        out.send(Done(rid, "stop", {}, {}))
    assert out.hold() == 0.02  # all done: back to the interval
    assert Outbox(Pipe(), interval=0.0).hold() == 0.0  # 0 stays one message per token


def test_embeddings_equal_llama_in_process(engine, smollm2_path):
    import math

    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama

    texts = ["The sea is calm tonight.", "A recipe for bread", "x"]
    vectors, n_tokens = engine.embed(texts)
    ref = Llama(
        str(smollm2_path),
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        embedding=True,
        pooling_type=LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    )
    expected = ref.embed(texts, normalize=True)
    assert n_tokens == sum(len(ref.tokenize(t.encode())) for t in texts)
    for got, want in zip(vectors, expected, strict=True):
        assert len(got) == 576
        assert math.isclose(sum(x * x for x in got), 1.0, rel_tol=1e-5)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    # Similar texts are closer than unrelated ones, and generation is untouched.
    a, b, c = engine.embed(["I love the ocean.", "I adore the sea.", "Tax forms are due."])[0]
    dot = lambda u, v: sum(x * y for x, y in zip(u, v, strict=True))  # noqa: E731
    assert dot(a, b) > dot(a, c)
    with pytest.raises(EngineError) as err:
        engine.embed(["word " * 600])
    assert err.value.code == codes.CONTEXT_LENGTH_EXCEEDED
    texts_after, _, _ = run(engine, [Request("g", chat_tokens(engine), 8, GREEDY)])
    assert texts_after["g"]


def detokenize(engine, ids: list[int]) -> str:
    return b"".join(engine.token_bytes(t) for t in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("cut", [1, 20, 45])
def test_a_resumed_generation_loses_and_repeats_nothing_in_throughput_mode(engine, cut):
    """Migration in the default mode: the text sent is exactly the text of the tokens
    already generated followed by the new ones, and every token counts once."""
    prompt = chat_tokens(engine, STORY)
    full, _ = _events(engine, Request("whole", prompt, 64, GREEDY))
    ids = [t for p in full[:cut] for t in p.token_ids]
    delivered = "".join(p.text for p in full[:cut])
    resumed = Request("resumed", prompt, 64, GREEDY, resume_tokens=ids)
    resumed.delivered_bytes = len(delivered.encode())
    rest, done = _events(engine, resumed)
    new_ids = [t for p in rest for t in p.token_ids]
    assert delivered + "".join(p.text for p in rest) == detokenize(engine, ids + new_ids)
    assert done.usage["completion_tokens"] == len(ids) + len(new_ids) == 64
    assert done.reason == "length"


def test_a_follow_up_reuses_the_cached_prompt(smollm2_path):
    """A chat's next turn evaluates only what is new; the slot keeps its KV in between."""
    e = BatchEngine(str(smollm2_path), context_length=1024, parallel=2, threads=2)
    try:
        turn1 = [{"role": "system", "content": "You are a helpful librarian. " * 20}] + CHAT
        t1 = chat_tokens(e, turn1)
        texts, done, _ = run(e, [Request("t1", t1, 16, GREEDY)])
        assert done["t1"].usage["cached_tokens"] == 0
        turn2 = turn1 + [
            {"role": "assistant", "content": texts["t1"]},
            {"role": "user", "content": "And of Spain?"},
        ]
        t2 = chat_tokens(e, turn2)
        _, done, _ = run(e, [Request("t2", t2, 16, GREEDY)])
        cached = done["t2"].usage["cached_tokens"]
        # Everything up to the first answer is reused (its re-tokenised text may differ in
        # its last tokens), and never the whole prompt: the last token gives the logits.
        assert len(t1) <= cached < len(t2)
        # The same prompt again: all but its last token come from the cache.
        _, again, _ = run(e, [Request("t2b", t2, 4, GREEDY)])
        assert again["t2b"].usage["cached_tokens"] == len(t2) - 1
        # Asked not to, the engine evaluates the whole prompt.
        _, cold, _ = run(e, [Request("t2c", t2, 4, GREEDY, cache_prompt=False)])
        assert cold["t2c"].usage["cached_tokens"] == 0
    finally:
        e.close()


def test_each_conversation_finds_its_own_slot(smollm2_path):
    """Two conversations take turns: each new turn goes to the slot holding its history,
    not to the other conversation's (longest common prefix wins)."""
    e = BatchEngine(str(smollm2_path), context_length=1024, parallel=2, threads=2)
    try:
        a, b = chat_tokens(e, OWLS), chat_tokens(e, TRAINS)
        run(e, [Request("a1", a, 4, GREEDY)])
        _, db1, _ = run(e, [Request("b1", b, 4, GREEDY)])
        # b's first turn shares only the template's opening with a: copied into the free
        # slot, without taking a's slot.
        assert db1["b1"].usage["cached_tokens"] == common_prefix(a, b) > 0
        _, da, _ = run(e, [Request("a2", a, 4, GREEDY)])
        _, db, _ = run(e, [Request("b2", b, 4, GREEDY)])
        assert da["a2"].usage["cached_tokens"] == len(a) - 1
        assert db["b2"].usage["cached_tokens"] == len(b) - 1
    finally:
        e.close()


def test_a_prefix_pushed_out_of_its_slot_comes_back_from_host_ram(smollm2_path):
    """One slot, two conversations taking turns: each turn pushes the other's history out
    of the slot, and the host-RAM cache brings it back, so the turn evaluates only its last
    token, and its text equals what the same turn gives with its history still in a slot."""
    kept = BatchEngine(str(smollm2_path), context_length=1024, parallel=2, threads=2)
    try:
        a, b = chat_tokens(kept, OWLS), chat_tokens(kept, TRAINS)
        run(kept, [Request("a1", a, 8, GREEDY)])
        expected, done, _ = run(kept, [Request("a2", a, 8, GREEDY)])
        assert done["a2"].usage["host_cached_tokens"] == 0  # still in its slot
    finally:
        kept.close()
    for limit, restored in ((64 << 20, True), (0, False)):
        e = BatchEngine(
            str(smollm2_path), context_length=1024, parallel=1, threads=2, host_cache_bytes=limit
        )
        try:
            run(e, [Request("a1", a, 8, GREEDY)])
            _, db, _ = run(e, [Request("b1", b, 8, GREEDY)])
            assert db["b1"].usage["cached_tokens"] == common_prefix(a, b)  # the template's start
            texts, da, _ = run(e, [Request("a2", a, 8, GREEDY)])
            usage = da["a2"].usage
            if restored:
                assert usage["cached_tokens"] == usage["host_cached_tokens"] == len(a) - 1
                assert texts["a2"] == expected["a2"]
                # a's entry left the cache for the slot; b's history took its place.
                assert [x.tokens[: len(b)] for x in e.host.entries] == [b]
                assert usage["host_cache_bytes"] == e.host.bytes > 0
            else:
                assert usage["cached_tokens"] == common_prefix(a, b)
                assert usage["host_cached_tokens"] == 0 and not e.host.entries
        finally:
            e.close()


def test_a_regenerated_answer_is_not_copied_to_host_ram_an_edit_is(smollm2_path):
    """The same prompt again (the answer regenerated) throws away only the slot's last
    answer: that is not copied to host RAM first (llama-server neither), so the prompt
    waits for no copy. A prompt that throws away part of the conversation's prompt (an
    edit) still has it copied."""
    e = BatchEngine(str(smollm2_path), context_length=1024, parallel=1, threads=2)
    try:
        a = chat_tokens(e, OWLS)
        run(e, [Request("a1", a, 48, GREEDY)])
        _, done, _ = run(e, [Request("again", a, 48, GREEDY)])
        assert done["again"].usage["cached_tokens"] == len(a) - 1
        assert not e.host.entries and e.host.bytes == 0
        edited = a[: len(a) // 2] + chat_tokens(e, TRAINS)[1:]
        run(e, [Request("edited", edited, 8, GREEDY)])
        assert [x.tokens[: len(a)] for x in e.host.entries] == [a]
    finally:
        e.close()


def test_an_idle_engine_copies_a_slot_to_host_ram_before_a_request_needs_it(
    smollm2_path, monkeypatch
):
    """save_ahead copies a finished conversation to host RAM while nothing runs, once, so
    the request that later pushes it out of its slot makes no copy on its way to its first
    token, and the conversation still comes back from host RAM. Nothing is copied while a
    request waits or runs, nor a sequence over SAVE_AHEAD_BYTES (its slot's next request
    copies it, as before)."""
    from workers.engine import core

    e = BatchEngine(
        str(smollm2_path), context_length=1024, parallel=1, threads=2, host_cache_bytes=64 << 20
    )
    try:
        a, b = chat_tokens(e, OWLS), chat_tokens(e, TRAINS)
        run(e, [Request("a1", a, 8, GREEDY)])
        e.submit(Request("b1", b, 8, GREEDY))
        assert not e.save_ahead() and not e.host.entries  # b1 waits: nothing copied
        run(e, [])
        assert e.save_ahead()  # b1's history; a's left for host RAM when b1 took the slot
        assert not e.save_ahead()  # once
        assert [x.tokens[: len(b)] for x in e.host.entries] == [a[: len(b)], b]
        saved_b = e.host.entries[1]
        _, da, _ = run(e, [Request("a2", a, 8, GREEDY)])
        assert da["a2"].usage["host_cached_tokens"] == len(a) - 1
        assert saved_b in e.host.entries  # a2 pushed b out: the copy made ahead, not another
        assert len(e.host.entries) == 1

        monkeypatch.setattr(core, "SAVE_AHEAD_BYTES", 1)
        assert e.save_ahead() and not e.save_ahead()
        assert len(e.host.entries) == 1  # a2's history is over the bound: not copied ahead
        _, db, _ = run(e, [Request("b2", b, 8, GREEDY)])
        assert db["b2"].usage["host_cached_tokens"] == len(b) - 1
        assert [x.tokens[: len(a)] for x in e.host.entries] == [a]  # copied when b2 came
    finally:
        e.close()


def test_a_restore_in_the_same_step_leaves_a_copied_prefix_alone(smollm2_path):
    """Two requests admitted together: A copies a shared system prompt from slot S into
    another slot (llama.cpp moves the data at the next decode), and B's history comes back
    from host RAM into the least valuable free slot, S here. Restored into S at once, B's
    KV reached A's slot through the copy, and A's answer was no longer its own (in a probe
    it went on about B's trains); the restore now takes a slot no pending copy touches."""
    system = {"role": "system", "content": "You are a patient tutor of physics. " * 12}
    sky = [system, {"role": "user", "content": "Why is the sky blue? Explain sunsets, " * 4}]
    ships = [system, {"role": "user", "content": "Why do ships float?"}]
    e = BatchEngine(str(smollm2_path), context_length=1024, parallel=3, threads=2)
    try:
        a = chat_tokens(e, ships)
        alone, _, _ = run(e, [Request("alone", a, 24, GREEDY, cache_prompt=False)])
    finally:
        e.close()
    e = BatchEngine(str(smollm2_path), context_length=1024, parallel=3, threads=2)
    try:
        s, b = chat_tokens(e, sky), chat_tokens(e, TRAINS)
        hi = chat_tokens(e, [{"role": "user", "content": "Hi"}])
        # Slots: b, s, owls; "hi" pushes b out to host RAM; then s and owls again, so that
        # "hi" is the least valuable slot, then s's.
        for rid, prompt in [("b", b), ("s", s), ("w", chat_tokens(e, OWLS)), ("hi", hi)]:
            run(e, [Request(rid, prompt, 8, GREEDY)])
        assert [x.tokens[: len(b)] for x in e.host.entries] == [b]
        run(e, [Request("s2", s, 1, GREEDY)])
        run(e, [Request("w2", chat_tokens(e, OWLS), 1, GREEDY)])
        texts, done, _ = run(e, [Request("A", a, 24, GREEDY), Request("B", b, 8, GREEDY)])
        assert done["A"].usage["cached_tokens"] == common_prefix(a, s) > 100  # copied
        assert done["B"].usage["host_cached_tokens"] == len(b) - 1  # restored
        # Greedy text from a cached prefix may drift from the solo run's after a while (a
        # prefix read in another batch differs in its last bits); with B's KV it differed
        # from the second word on.
        assert texts["A"].split()[:6] == alone["alone"].split()[:6]
        assert "train" not in texts["A"].lower()
    finally:
        e.close()


def test_a_sliding_window_entry_serves_only_prompts_that_reach_its_end(gemma_path):
    """gemma-3's window is 512 tokens, and a saved sequence keeps only the window's last
    cells: the same 600-token prompt again cannot use it (the cells before the window of
    its last token are gone), the next turn, which runs on past the entry's end, can."""
    e = BatchEngine(str(gemma_path), context_length=1024, parallel=1, threads=2)
    try:
        assert e.n_swa == 512

        def tokens(topic):
            return e.tokenize(f"Notes on {topic}. " * 160, add_bos=True, special=False)

        a, b = tokens("owls"), tokens("trains")
        assert 600 < len(a) < 900 and 600 < len(b) < 900
        run(e, [Request("a1", a, 4, GREEDY)])
        run(e, [Request("b1", b, 4, GREEDY)])
        (saved,) = [x.tokens for x in e.host.entries]
        assert saved[: len(a)] == a
        _, again, _ = run(e, [Request("a-again", a, 4, GREEDY)])
        assert again["a-again"].usage["host_cached_tokens"] == 0
        assert again["a-again"].usage["cached_tokens"] == common_prefix(a, b)
        run(e, [Request("b2", b, 4, GREEDY)])  # the slot holds b again
        follow_up = saved + e.tokenize(" And owls at night?", add_bos=False, special=False)
        texts, later, errors = run(e, [Request("a2", follow_up, 4, GREEDY)])
        assert not errors and texts["a2"]
        assert later["a2"].usage["cached_tokens"] == len(saved)
        assert later["a2"].usage["host_cached_tokens"] == len(saved)
    finally:
        e.close()


def test_a_slot_holding_only_a_window_is_not_reused_for_its_first_tokens(gemma_path):
    """A sequence restored from host RAM holds only its last window in the sliding-window
    layers. A new prompt sharing just the template's opening with it (4 tokens) cut it
    there, which left those layers no cell at all, and the check let it pass: the prompt
    was read without its start, and gemma's first token was an end of generation (the
    empty answers of the bench's failover). It is read whole now, as when run alone."""

    e = BatchEngine(str(gemma_path), context_length=1024, parallel=1, threads=2)
    try:
        question = gemma_turn(e, "Why is the sky blue?")
        alone, _, _ = run(e, [Request("alone", question, 16, GREEDY, cache_prompt=False)])
    finally:
        e.close()
    e = BatchEngine(str(gemma_path), context_length=1024, parallel=1, threads=2)
    try:
        a, b = gemma_turn(e, "Notes on owls. " * 160), gemma_turn(e, "Notes on trains. " * 160)
        assert common_prefix(a, question) == 4 and len(a) > e.n_swa + 100
        run(e, [Request("a", a, 4, GREEDY)])
        run(e, [Request("b", b, 4, GREEDY)])  # a goes to host RAM
        (saved,) = [x.tokens for x in e.host.entries]
        follow_up = saved + e.tokenize(" And owls at night?", add_bos=False, special=False)
        _, done, _ = run(e, [Request("a2", follow_up, 4, GREEDY)])
        assert done["a2"].usage["host_cached_tokens"] == len(saved)  # only its window came back
        texts, done, errors = run(e, [Request("q", question, 16, GREEDY)])
        assert not errors and done["q"].usage["completion_tokens"] == 16
        assert done["q"].usage["cached_tokens"] == 0
        assert texts["q"] == alone["alone"]
    finally:
        e.close()


def test_a_shared_prefix_comes_from_a_slot_that_still_holds_its_window(gemma_path):
    """Two free slots share a system prompt with a new request: the one used least recently
    holds a conversation restored from host RAM, so only its last window; the other holds
    all of its own. The prompt must come from the second (llama-server's check before the
    cut): from the first it was read without its start (the answer began "You are the
    responsible for the model" instead of the solo run's text)."""

    system = "You are the careful reading assistant of the city library. " * 8
    e = BatchEngine(str(gemma_path), context_length=1024, parallel=2, threads=2)
    try:
        question = gemma_turn(e, system + " Why is the sky blue?")
        alone, _, _ = run(e, [Request("alone", question, 16, GREEDY, cache_prompt=False)])
    finally:
        e.close()
    e = BatchEngine(str(gemma_path), context_length=1024, parallel=2, threads=2)
    try:
        a, b, c = (
            gemma_turn(e, system + f" Notes on {t}. " * 140) for t in ("owls", "trains", "ships")
        )
        for rid, prompt in [("a", a), ("b", b), ("c", c)]:  # c pushes a out to host RAM
            run(e, [Request(rid, prompt, 4, GREEDY)])
        (saved,) = [x.tokens for x in e.host.entries if x.tokens[: len(a)] == a]
        follow_up = saved + e.tokenize(" And owls at night?", add_bos=False, special=False)
        _, done, _ = run(e, [Request("a2", follow_up, 4, GREEDY)])
        assert done["a2"].usage["host_cached_tokens"] == len(saved)  # into b's slot
        run(e, [Request("c2", c, 4, GREEDY)])  # a2's slot is now the one used least recently
        texts, done, errors = run(e, [Request("q", question, 16, GREEDY)])
        assert not errors and done["q"].usage["cached_tokens"] == common_prefix(question, c)
        assert texts["q"] == alone["alone"]
    finally:
        e.close()


@pytest.mark.parametrize("swa_full", [True, False], ids=["full", "window"])
def test_a_window_cache_keeps_a_conversation_but_not_its_early_prefixes(gemma_path, swa_full):
    """swa_full=False (a deployment's default swa_cache, llama-server's default) keeps about
    a window of cells per slot in gemma's sliding-window layers, where the full cache keeps
    every position. The next turn of a conversation longer than that still reuses all of
    it; a prompt sharing only its first 600 tokens cannot (those layers no longer hold the
    window before token 600) and is read whole, with the text of a run without cache. The
    full cache reuses those 600 tokens."""
    import llama_cpp as L

    e = BatchEngine(str(gemma_path), context_length=2048, parallel=1, threads=2, swa_full=swa_full)
    try:
        long = e.tokenize("Notes on owls. " * 350, add_bos=True, special=False)
        assert 1200 < len(long) < 1900
        run(e, [Request("r1", long, 4, GREEDY)])
        held = L.llama_memory_seq_pos_min(e.memory, 0)
        assert (held == 0) if swa_full else (held > 600 - e.n_swa)
        history = list(e.slots[0].cached)
        follow_up = history + e.tokenize(" And owls at night?", add_bos=False, special=False)
        texts, done, errors = run(e, [Request("r2", follow_up, 4, GREEDY)])
        assert not errors and texts["r2"]
        assert done["r2"].usage["cached_tokens"] == len(history)
        early = long[:600] + e.tokenize(" Now trains.", add_bos=False, special=False)
        texts, done, errors = run(e, [Request("r3", early, 8, GREEDY)])
        assert not errors
        assert done["r3"].usage["cached_tokens"] == (600 if swa_full else 0)
        if not swa_full:
            solo, _, _ = run(e, [Request("solo", early, 8, GREEDY, cache_prompt=False)])
            assert texts["r3"] == solo["solo"]
    finally:
        e.close()


def test_a_shared_system_prompt_survives_the_window_cache_as_a_checkpoint(gemma_path):
    """With the window cache a slot whose conversation ran past about a window of cells
    keeps no sliding-window cell of its start, so a new conversation under the same system
    prompt could not reuse it and was read whole, in every slot, every time. The first
    prompt that shares it copies its state at the shared prefix's end to host RAM; the
    next conversations restore that checkpoint into any slot (it stays for the next),
    with the text of a run without cache."""
    import llama_cpp as L

    from apps.catalog.sources import GEMMA_CHAT_TEMPLATE

    system = "You are the careful reading assistant of the city library. " * 12
    e = BatchEngine(str(gemma_path), context_length=2048, parallel=2, threads=2, swa_full=False)
    try:

        def conversation(user):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return chat_tokens(e, messages, GEMMA_CHAT_TEMPLATE)

        a = conversation("Notes on owls. " * 230)
        b = conversation("Why is the sky blue? " + "Notes on trains. " * 230)
        c = conversation("What do ships carry?")
        prefix = common_prefix(b, c)
        assert prefix > 100 and common_prefix(a, b) == prefix
        run(e, [Request("a", a, 4, GREEDY)])
        assert L.llama_memory_seq_pos_min(e.memory, 0) > 0  # a's start left the window
        _, done, _ = run(e, [Request("b", b, 4, GREEDY)])
        assert done["b"].usage["cached_tokens"] == 0  # read whole, as before
        assert [(len(x.tokens), x.kept) for x in e.host.entries] == [(prefix, True)]
        assert L.llama_memory_seq_pos_min(e.memory, 1) > 0  # both slots ran past the window
        # Each slot checkpointed only its prompt's end (nothing reused); c cannot use them.
        assert sorted(c.n for s in e.slots for c in s.checkpoints) == sorted([len(a), len(b)])
        texts, done, errors = run(e, [Request("c", c, 16, GREEDY)])
        assert not errors
        assert done["c"].usage["cached_tokens"] == done["c"].usage["host_cached_tokens"] == prefix
        assert any(x.kept and len(x.tokens) == prefix for x in e.host.entries)
        solo, _, _ = run(e, [Request("solo", c, 16, GREEDY, cache_prompt=False)])
        assert texts["c"] == solo["solo"]
    finally:
        e.close()


def test_an_edited_last_message_restores_the_slots_window_checkpoint(gemma_path):
    """With the window cache a slot whose last turn ran a window past its start no longer
    holds the window before that turn, so a prompt that goes back there (the last message
    edited, the answer regenerated) was read whole. A slot that goes on with its own
    tokens first copies its window's cells; such a prompt restores them and reads only
    what follows, with the text of a run without cache."""
    import llama_cpp as L

    # One slot: with two, the edited prompt went to the other, which still held the history
    # (the first prompt had been copied away from it), and no checkpoint was needed.
    e = BatchEngine(str(gemma_path), context_length=2048, parallel=1, threads=2, swa_full=False)
    try:
        history = gemma_turn(e, "You are the careful reading assistant of the city library. " * 8)
        first = gemma_turn(e, "Notes on owls and their habits. " * 180)
        edited = gemma_turn(e, "Notes on trains and their timetables. " * 160)
        run(e, [Request("h", history, 4, GREEDY)])
        _, done, _ = run(e, [Request("first", history + first, 4, GREEDY)])
        assert done["first"].usage["cached_tokens"] == len(history)
        slot = e.slots[0]
        assert [c.n for c in slot.checkpoints] == [len(history), len(history + first)]
        assert L.llama_memory_seq_pos_min(e.memory, slot.seq_id) > 0  # the window is gone
        assert not e._window_holds(slot.seq_id, len(history))
        texts, done, errors = run(e, [Request("edited", history + edited, 16, GREEDY)])
        assert not errors
        n = common_prefix(history + first, history + edited)
        assert done["edited"].usage["cached_tokens"] == len(history) < n < len(history) + 8
        assert done["edited"].usage["host_cached_tokens"] == 0  # the slot's own checkpoint
        # The first prompt's end went with it; the edited prompt's end is checkpointed.
        assert [c.n for c in slot.checkpoints] == [len(history), len(history + edited)]
        solo, _, _ = run(e, [Request("solo", history + edited, 16, GREEDY, cache_prompt=False)])
        assert texts["edited"] == solo["solo"]
    finally:
        e.close()


def long_story_chat(e: BatchEngine) -> tuple[list[dict], list[int], list[int], int]:
    """A gemma conversation whose second answer runs a window past its prompt: the messages
    before its second question, its first prompt, its second prompt, and how many tokens the
    second reused."""
    from apps.catalog.sources import GEMMA_CHAT_TEMPLATE

    system = "You are the careful reading assistant of the city library. " * 40
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Write a long story about a dragon."},
    ]
    first = chat_tokens(e, messages, GEMMA_CHAT_TEMPLATE)
    texts, _, _ = run(e, [Request("1", first, 64, GREEDY)])
    messages.append({"role": "assistant", "content": texts["1"]})
    question = {"role": "user", "content": "Write a long story about a city under the ice."}
    prompt = chat_tokens(e, [*messages, question], GEMMA_CHAT_TEMPLATE)
    _, done, _ = run(e, [Request("2", prompt, 640, GREEDY)])
    reused = done["2"].usage["cached_tokens"]
    assert reused > 400 and done["2"].usage["completion_tokens"] > 600
    return messages, first, prompt, reused


def test_an_edit_further_back_restores_an_older_window_checkpoint(gemma_path):
    """A message edited two turns before the last goes back to where that turn's prompt
    began: past the last two prompts' checkpoints (FIRM_CHECKPOINTS). Between turns, while
    idle, the slot gets buffers for its next checkpoints (a fresh one on the way to a first
    token cost up to 15 ms), and with them keeps its older checkpoints instead of letting
    them go for their buffers (llama-server keeps 32 a slot)."""
    from apps.catalog.sources import GEMMA_CHAT_TEMPLATE
    from workers.engine.core import FIRM_CHECKPOINTS

    e = BatchEngine(str(gemma_path), context_length=2048, parallel=2, threads=2, swa_full=False)
    try:
        messages, _, prompt, reused = long_story_chat(e)
        while e.save_ahead():  # the user reads the answer
            pass
        slot = next(s for s in e.slots if s.cached)
        assert len(slot.spares) == 2
        answer = b"".join(e.token_bytes(t) for t in slot.cached[len(prompt) :])
        question = {"role": "user", "content": "Write a long story about a city under the ice."}
        history = [*messages, question, {"role": "assistant", "content": answer.decode()}]
        for k, q in enumerate(("Who was the mayor?", "What did the dragon eat?")):
            history.append({"role": "user", "content": q})
            turn = chat_tokens(e, history, GEMMA_CHAT_TEMPLATE)
            texts, _, _ = run(e, [Request(f"t{k}", turn, 16, GREEDY)])
            history.append({"role": "assistant", "content": texts[f"t{k}"]})
            while e.save_ahead():
                pass
        assert len(slot.checkpoints) > FIRM_CHECKPOINTS
        assert reused in [c.n for c in slot.checkpoints]  # where the second prompt began
        edited = [*messages, {"role": "user", "content": "Write a long story about a lighthouse."}]
        tokens = chat_tokens(e, edited, GEMMA_CHAT_TEMPLATE)
        texts, done, errors = run(e, [Request("edit", tokens, 16, GREEDY)])
        assert not errors and done["edit"].usage["cached_tokens"] >= reused - 8
        solo, _, _ = run(e, [Request("solo", tokens, 16, GREEDY, cache_prompt=False)])
        assert texts["edit"] == solo["solo"]
    finally:
        e.close()


def test_a_regenerated_long_answer_restores_the_slots_window_checkpoint(gemma_path):
    """The same for an answer regenerated after it ran a window past its prompt: the
    window is copied where the prompt's new tokens begin, before they are read (llama.cpp
    reused its cells within the answer when the copy came later), and where the prompt
    ends, before the answer; the same prompt again reads only its last token."""
    e = BatchEngine(str(gemma_path), context_length=2048, parallel=2, threads=2, swa_full=False)
    try:
        _, first, prompt, reused = long_story_chat(e)
        slot = next(s for s in e.slots if s.cached)
        assert [c.n for c in slot.checkpoints] == [len(first), reused, len(prompt)]
        assert not e._window_holds(slot.seq_id, len(prompt) - 1)  # the answer ran past it
        texts, done, errors = run(e, [Request("again", prompt, 16, GREEDY)])
        assert not errors and done["again"].usage["cached_tokens"] == len(prompt) - 1
        assert [c.n for c in slot.checkpoints] == [len(first), reused, len(prompt)]
        solo, _, _ = run(e, [Request("solo", prompt, 16, GREEDY, cache_prompt=False)])
        assert texts["again"] == solo["solo"]
    finally:
        e.close()


def test_a_conversation_pushed_to_host_ram_takes_its_window_checkpoints_along(gemma_path):
    """Another conversation takes the only slot: the first one goes to host RAM, where it
    keeps only its last window, and the slot's window checkpoints go with it. Its answer
    regenerated then reads only the prompt's last token from the entry (the checkpoints
    come back to the slot with it), and, pushed out again, its last message edited reads
    from where that message starts; each with the text of a run without cache. Before,
    both read the whole conversation again."""
    from apps.catalog.sources import GEMMA_CHAT_TEMPLATE

    e = BatchEngine(str(gemma_path), context_length=2048, parallel=1, threads=2, swa_full=False)
    try:
        messages, first, prompt, reused = long_story_chat(e)
        [slot] = e.slots
        assert [c.n for c in slot.checkpoints] == [len(first), reused, len(prompt)]
        other = gemma_turn(e, "Notes on trains and their timetables. " * 20)
        run(e, [Request("other", other, 8, GREEDY)])
        [entry] = [x for x in e.host.entries if x.tokens[: len(prompt)] == prompt]
        assert [c.n for c in entry.checkpoints] == [len(first), reused, len(prompt)]
        assert not slot.checkpoints or slot.cached[:8] == other[:8]

        texts, done, errors = run(e, [Request("again", prompt, 16, GREEDY)])
        assert not errors
        assert done["again"].usage["cached_tokens"] == len(prompt) - 1
        assert done["again"].usage["host_cached_tokens"] == len(prompt) - 1
        assert [c.n for c in slot.checkpoints] == [len(first), reused, len(prompt)]
        solo, _, _ = run(e, [Request("solo", prompt, 16, GREEDY, cache_prompt=False)])
        assert texts["again"] == solo["solo"]

        # Pushed out again; then its last message edited: from the entry, back to where
        # that message starts.
        run(e, [Request("other", other + gemma_turn(e, "And buses?")[1:], 8, GREEDY)])
        question = {"role": "user", "content": "Write a short poem about the sea."}
        edited = chat_tokens(e, [*messages, question], GEMMA_CHAT_TEMPLATE)
        assert e.slots[0].cached[: len(other)] == other
        texts, done, errors = run(e, [Request("edited", edited, 16, GREEDY)])
        assert not errors and done["edited"].usage["cached_tokens"] == reused
        assert done["edited"].usage["host_cached_tokens"] == reused
        solo, _, _ = run(e, [Request("solo", edited, 16, GREEDY, cache_prompt=False)])
        assert texts["edited"] == solo["solo"]
    finally:
        e.close()


def test_no_window_checkpoint_is_copied_from_a_slot_past_the_prefixs_window(gemma_path):
    """llama.cpp saves only the cells a sequence's last position still sees. A prompt that
    copies a shared system prompt from a slot holding more than a window beyond it would
    checkpoint cells without the system prompt's window: none is made (it cost a copy, and
    a restore of it read the whole prompt). The checkpoint of the prompt's own end is."""
    e = BatchEngine(str(gemma_path), context_length=2048, parallel=2, threads=2, swa_full=False)
    try:
        system = gemma_turn(e, "You are the careful reading assistant of the city library. " * 8)
        long = gemma_turn(e, "Notes on owls and their habits. " * 90)
        question = gemma_turn(e, "What do trains carry? " * 70)
        n = common_prefix(system + long, system + question)
        run(e, [Request("a", system + long, 4, GREEDY)])
        held = next(s for s in e.slots if s.cached)
        assert len(held.cached) - n > e.n_swa
        assert e._window_holds(held.seq_id, n)  # the copy is worth making
        _, done, _ = run(e, [Request("b", system + question, 64, GREEDY)])
        assert done["b"].usage["cached_tokens"] == n
        other = next(s for s in e.slots if s is not held)
        assert [c.n for c in other.checkpoints] == [len(system + question)]
    finally:
        e.close()


def test_a_slots_older_window_checkpoints_and_spares_only_fill_room_nothing_else_needs():
    """A slot keeps up to SLOT_CHECKPOINTS window checkpoints; only its newest
    FIRM_CHECKPOINTS (the last two prompts') may push host-RAM entries out. Its older ones
    and its spare buffers use room nothing else asks for, and go first, the oldest first,
    when an entry or a newer checkpoint needs it; except the spares of the slot used last,
    readied for the turn likeliest to come next."""
    from workers.engine.core import FIRM_CHECKPOINTS, _Slot, _WindowCheckpoint

    cache = HostCache(limit_bytes=1000)
    a, b = _Slot(0, last_used=1.0), _Slot(1, last_used=2.0)
    cache.slots = [a, b]
    for slot in (a, b, a):  # a's are the oldest and the newest
        for n in range(FIRM_CHECKPOINTS):
            assert cache.reserve(50)
            slot.checkpoints.append(_WindowCheckpoint(10 * n, data(50), 50))
    assert cache.bytes == 600 and len(a.checkpoints) == 2 * FIRM_CHECKPOINTS
    for slot in (a, b):  # a spare each, from free room
        assert cache.reserve(100, Room.FREE)
        slot.spares.append(data(100))
    assert not cache.reserve(201, Room.FREE) and cache.bytes == 800  # no room: nothing dropped
    cache.add([1] * 40, data(450))  # an entry: a's spare goes, then a's three oldest
    assert not a.spares and len(b.spares) == 1 and cache.bytes == 1000
    assert [len(s.checkpoints) for s in (a, b)] == [FIRM_CHECKPOINTS + 1, FIRM_CHECKPOINTS]
    cache.add([2] * 40, data(300))  # a's last older one, then the entry before
    assert [e.tokens[0] for e in cache.entries] == [2] and cache.bytes == 800
    assert [len(s.checkpoints) for s in (a, b)] == [FIRM_CHECKPOINTS, FIRM_CHECKPOINTS]
    # The newest checkpoints and b's spare hold their room; new checkpoints take the entry's.
    assert not cache.reserve(701) and cache.bytes == 800
    assert cache.reserve(200) and cache.reserve(100) and not cache.entries
    assert cache.bytes == 800 and len(b.spares) == 1
    # A copy made ahead of need (of a slot that still holds it) takes room from entries,
    # not from older checkpoints: those are the only copy of what they hold.
    cache.add([3] * 40, data(100))
    older = _WindowCheckpoint(5, data(50), 50)
    assert cache.reserve(50, Room.FREE) and cache.bytes == 950
    a.checkpoints.insert(0, older)
    cache.add([4] * 40, data(100), room=Room.ENTRIES)
    assert older in a.checkpoints and [e.tokens[0] for e in cache.entries] == [4]
    assert cache.reserve(100, Room.ENTRIES)  # a spare for b, likewise
    assert older in a.checkpoints and not cache.entries and cache.bytes == 950
    cache.add([5] * 40, data(100))  # a copy made at need: the older checkpoint goes
    assert older not in a.checkpoints and [e.tokens[0] for e in cache.entries] == [5]
    assert cache.bytes == 1000


def test_an_entry_let_go_for_room_takes_its_window_checkpoints_with_it():
    """An entry's window checkpoints serve only restored over it: when it goes, their bytes
    go too, and under Room.ALL they count as room that can be made (one list, _droppable,
    says both what may go and in which order)."""
    from workers.engine.core import _WindowCheckpoint

    cache = HostCache(limit_bytes=1000)
    cache.add([1] * 40, data(300))
    assert cache.reserve(200)  # a slot's checkpoint of that prompt, handed to the entry
    assert cache.attach([1] * 20, [_WindowCheckpoint(20, data(200), 200)])
    assert cache.bytes == 500
    cache.add([2] * 40, data(600), room=Room.ENTRIES)  # made ahead: the entry goes whole
    assert [e.tokens[0] for e in cache.entries] == [2] and cache.bytes == 600
    cache.add([3] * 40, data(100))
    assert cache.reserve(100) and cache.attach([3] * 20, [_WindowCheckpoint(20, data(100), 100)])
    assert cache.bytes == 800
    # Under Room.ALL the entries' checkpoints go before the entries, even the older entry.
    assert cache.reserve(250) and [e.tokens[0] for e in cache.entries] == [2, 3]
    assert not cache.entries[1].checkpoints and cache.bytes == 950
    assert not cache.reserve(751) and cache.bytes == 950  # the 250 hold their room
    assert cache.reserve(750) and not cache.entries and cache.bytes == 1000


def test_window_checkpoints_count_against_the_host_cache_and_make_room_in_it():
    cache = HostCache(limit_bytes=300)
    cache.add([1, 2, 3], data(100))
    cache.add([4, 5, 6], data(100))
    assert cache.reserve(150) and cache.bytes == 250  # the oldest entry made room
    assert [e.tokens for e in cache.entries] == [[4, 5, 6]]
    assert not cache.reserve(200) and cache.bytes == 250  # beside the first: no room
    cache.add([7, 8, 9], data(200))  # likewise, and nothing is dropped for it
    assert [e.tokens for e in cache.entries] == [[4, 5, 6]] and cache.bytes == 250
    cache.add([1], data(100))  # an entry that fits beside it takes the oldest's place
    assert [e.tokens for e in cache.entries] == [[1]] and cache.bytes == 250
    cache.release(150)
    cache.add([7, 8, 9], data(200))
    assert [e.tokens for e in cache.entries] == [[1], [7, 8, 9]] and cache.bytes == 300


def test_the_invariant_mode_keeps_the_full_window_cache(gemma_path):
    """The invariant mode's text must equal Llama's in-process, which keeps the full cache:
    a window cache asked for is not applied there."""
    e = BatchEngine(str(gemma_path), 256, 1, 2, batch_invariant=True, swa_full=False)
    try:
        assert e.swa_full
    finally:
        e.close()


def test_the_host_cache_drops_the_oldest_and_what_a_newer_entry_contains():
    cache = HostCache(limit_bytes=300)
    cache.add([1, 2, 3], data(100))
    cache.add([1, 2, 3, 4, 5], data(100))  # contains the first: it goes
    assert [e.tokens for e in cache.entries] == [[1, 2, 3, 4, 5]] and cache.bytes == 100
    cache.add([7, 8], data(100))
    cache.add([9, 9, 9], data(150))  # over 300 bytes: the oldest goes
    assert [e.tokens for e in cache.entries] == [[7, 8], [9, 9, 9]] and cache.bytes == 250
    cache.add([6] * 10, data(301))  # larger than the whole cache: not kept
    assert cache.bytes == 250
    assert cache.holds([9, 9]) and not cache.holds([9, 9, 9, 9])
    # The longest prefix wins only when longer than what a slot has.
    entry, n, via = cache.best([9, 9, 9, 1], than=0, n_swa=0)
    assert entry.tokens == [9, 9, 9] and n == 3 and via is None
    assert cache.best([9, 9, 9, 1], than=3, n_swa=0) == (None, 3, None)
    # An entry must keep a quarter of itself.
    cache.add(list(range(100, 140)), data(10))
    assert cache.best(list(range(100, 109)) + [0], than=0, n_swa=0)[0] is None
    assert cache.best(list(range(100, 110)) + [0], than=0, n_swa=0)[1] == 10
    # With a sliding window only the window's last cells were saved: a prompt must reach
    # the entry's end, or stay within the first window.
    assert cache.best(list(range(100, 130)), than=0, n_swa=8)[0] is None
    assert cache.best(list(range(100, 140)) + [0], than=0, n_swa=8)[1] == 40
    assert cache.best(list(range(100, 130)), than=0, n_swa=64)[1] == 30
    taken = cache.entries[-1]
    cache.take(taken)
    assert taken not in cache.entries
    # Its buffer is the spare for the next save, counted until then.
    assert cache.spare is taken.data and cache.bytes == 260
    reused = cache.buffer(8)
    assert reused is taken.data and cache.spare is None and cache.bytes == 250
    cache.add([5, 5], reused, 8)
    assert cache.entries[-1].size == 8 and cache.bytes == 260
    cache.take(cache.entries[-1])
    fresh = cache.buffer(4)  # the spare would waste more than half of itself
    assert fresh is not reused and len(fresh) == 4 and cache.bytes == 250
    cache.take(cache.entries[-1])  # [9, 9, 9]: a spare of 150 bytes
    cache.add([4] * 4, data(200))  # no room: the spare goes before any entry
    assert cache.spare is None and [e.tokens for e in cache.entries] == [[7, 8], [4] * 4]


def test_a_checkpoint_stays_in_the_host_cache_when_it_serves_and_when_a_longer_entry_comes():
    """A checkpoint (a kept entry) is not handed over on restore, only made the newest, and
    a longer entry containing it does not replace it (under the window cache that entry
    keeps only its last window). Entries still go oldest first when room runs out."""
    cache = HostCache(limit_bytes=300)
    cache.add([1, 2, 3], data(100), kept=True)
    cache.add([7, 8], data(100))
    cache.add([1, 2, 3, 4, 5], data(50))  # contains the checkpoint: both stay
    assert [(e.tokens, e.kept) for e in cache.entries] == [
        ([1, 2, 3], True),
        ([7, 8], False),
        ([1, 2, 3, 4, 5], False),
    ]
    checkpoint = cache.entries[0]
    cache.take(checkpoint)  # restored into a slot
    assert cache.entries[-1] is checkpoint and cache.spare is None and cache.bytes == 250
    cache.add([9], data(100))  # no room: the oldest goes, now [7, 8]
    assert [e.tokens for e in cache.entries] == [[1, 2, 3, 4, 5], [1, 2, 3], [9]]
    cache.add([1, 2, 3], data(40), kept=True)  # the same prefix again replaces it
    assert [(e.tokens, len(e.data)) for e in cache.entries if e.kept] == [([1, 2, 3], 40)]


def test_common_prefix_finds_the_first_difference():
    import random

    rng = random.Random(7)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(5))]
        naive = 0
        while naive < min(len(a), len(b)) and a[naive] == b[naive]:
            naive += 1
        assert common_prefix(a, b) == common_prefix(b, a) == naive


def test_the_invariant_mode_keeps_no_prompt_cache(invariant):
    prompt = chat_tokens(invariant)
    run(invariant, [Request("x", prompt, 4, GREEDY)])
    _, done, _ = run(invariant, [Request("y", prompt, 4, GREEDY)])
    assert done["y"].usage["cached_tokens"] == 0


def test_prompts_arriving_together_are_read_shortest_first_within_the_budget(smollm2_path):
    """Throughput mode: prompts arriving together with nothing running are read in one
    step, as llama-server fills its batch (no stream waits on it). Prompts arriving beside
    running streams are read whole, the shortest first, at most PROMPT_BUDGET tokens a step,
    so the first ones reach their first token at once and the streams are not held up by
    all of them; those that fit are read in a step of their own, before the streams' next
    tokens, which come in the step after."""
    from workers.engine import core

    e = BatchEngine(str(smollm2_path), context_length=512, parallel=14, threads=2)
    try:
        topics = ["owls", "trains", "rain and thunder over the hills", "bread", "maps", "tea"]
        topics.append("snow falling on a quiet town at night")
        prompts = [chat_tokens(e, [{"role": "user", "content": f"On {t}."}]) for t in topics]
        assert len({len(p) for p in prompts}) > 1  # lengths differ: the order is by length
        assert sum(map(len, prompts)) > core.PROMPT_BUDGET  # the budget would bind here
        for i, p in enumerate(prompts):
            e.submit(Request(f"s{i}", p, 8, GREEDY))
        first = {ev.id for ev in e.step() if isinstance(ev, (Token, Done))}
        assert first == {f"s{i}" for i in range(7)}  # all read in the first step

        # Beside the 7 running streams the budget binds: the shortest whole prompts first.
        later = [
            chat_tokens(e, [{"role": "user", "content": f"About {t}, please."}]) for t in topics
        ]
        for i, p in enumerate(later):
            e.submit(Request(f"t{i}", p, 8, GREEDY))
        by_length = sorted(range(7), key=lambda i: (len(later[i]), i))
        running = {q.req.request_id for q in e.active.values() if q.req.request_id[0] == "s"}
        fits = max(
            k for k in range(8) if sum(len(later[i]) for i in by_length[:k]) <= core.PROMPT_BUDGET
        )
        assert 0 < fits < len(later)
        second = {ev.id for ev in e.step() if isinstance(ev, (Token, Done))}
        assert second == {f"t{i}" for i in by_length[:fits]}  # before the streams' tokens
        nxt = f"t{by_length[fits]}"
        [q] = [q for q in e.active.values() if q.req.request_id == nxt]
        assert q.prefill_pos == 0  # not begun: a part of a prompt gives no first token
        third = {ev.id for ev in e.step() if isinstance(ev, (Token, Done))}
        assert running <= third  # the streams advance in the next step
        first_step = {f"t{i}": 1 for i in by_length[:fits]}
        first_step.update((i, 2) for i in third if i[0] == "t" and i not in first_step)
        step = 2
        while len(first_step) < len(later):
            step += 1
            for ev in e.step():
                if isinstance(ev, (Token, Done)) and ev.id[0] == "t":
                    first_step.setdefault(ev.id, step)
        order = [first_step[f"t{i}"] for i in by_length]
        assert order == sorted(order)  # the shortest first
        while not e.idle():
            e.step()
    finally:
        e.close()


def test_a_short_prompt_beside_running_streams_is_read_first_but_never_twice_running(
    smollm2_path,
):
    """A short prompt arriving beside a running stream gets a step of its own (its first
    token does not wait for the stream's, which llama.cpp computes in a micro-batch of its
    own anyway); the stream advances in the next step whatever arrives, so it is never held
    for two steps in a row. With prompt_first off, both come in one step, as before."""
    e = BatchEngine(str(smollm2_path), context_length=512, parallel=6, threads=2)
    try:
        e.submit(Request("running", chat_tokens(e), 60, GREEDY))
        e.step()  # admitted and read
        while not e.active["running"].generated:
            e.step()
        advanced = []
        for k in range(4):
            if k == 3:
                e.prompt_first = False
            question = chat_tokens(e, [{"role": "user", "content": f"Question {k}?"}])
            e.submit(Request(f"q{k}", question, 30, GREEDY))
            before = e.active["running"].generated
            e.step()
            assert e.active[f"q{k}"].generated == 1  # its first token in this step
            advanced.append(e.active["running"].generated - before)
        assert advanced == [0, 1, 0, 1]
        while not e.idle():
            e.step()
    finally:
        e.close()


def test_a_short_prompt_does_not_wait_behind_a_long_one_being_read(smollm2_path):
    """A follow-up turn (a few new tokens) arriving while a new conversation's long prompt
    is read beside a running stream gets its first token after the next step; the long
    prompt goes on being read afterwards, and both texts come out whole."""
    from workers.engine import core

    e = BatchEngine(str(smollm2_path), context_length=512, parallel=4, threads=2)
    try:
        e.submit(Request("running", chat_tokens(e), 40, GREEDY))
        while not any(isinstance(ev, Token) for ev in e.step()):
            pass
        long_prompt = chat_tokens(e, [{"role": "user", "content": "Tell me about owls. " * 40}])
        e.submit(Request("long", long_prompt, 8, GREEDY))
        e.step()
        [long] = [q for q in e.active.values() if q.req.request_id == "long"]
        assert 0 < long.prefill_pos < len(long_prompt)  # cut: it is read over several steps
        short = chat_tokens(e, [{"role": "user", "content": "On bees."}])
        assert len(short) < core.PROMPT_BUDGET < len(long_prompt) - long.prefill_pos
        e.submit(Request("short", short, 8, GREEDY))
        events = e.step()
        got = {ev.id for ev in events if isinstance(ev, (Token, Done))}
        assert "short" in got and "long" not in got
        assert long.prefill_pos < len(long_prompt)  # still reading
        done = {}
        for _ in range(200):
            done |= {ev.id: ev for ev in events if isinstance(ev, Done)}
            if e.idle():
                break
            events = e.step()
        assert all(done[r].usage["completion_tokens"] > 0 for r in ("short", "long"))
        assert done["long"].usage["prompt_tokens"] == len(long_prompt)
    finally:
        e.close()


def test_a_step_over_scattered_slots_is_one_run_of_consecutive_slots(smollm2_path):
    """llama.cpp cuts a batch over several KV streams into micro-batches of consecutive
    sequence ids in batch order, each a pass over the weights: every step is laid out in
    slot order, and idle slots between busy ones get a filler token that leaves their
    prompt cache, and the other sequences' text, as they were."""
    topics = ["owls", "trains", "rain", "bread", "maps", "tea"]
    lengths = [24, 2, 24, 2, 2, 24]  # slots 1, 3 and 4 go idle early

    def serve(fill: bool):
        e = BatchEngine(str(smollm2_path), context_length=512, parallel=6, threads=2)
        layouts = []
        add = e._add

        def traced_add(i, token, pos, seq_id, logits):
            if i == 0:
                layouts.append([])
            layouts[-1].append(seq_id)
            add(i, token, pos, seq_id, logits)

        e._add = traced_add
        if not fill:
            e._fill_holes = lambda take: []
        try:
            prompts = [chat_tokens(e, [{"role": "user", "content": f"On {t}."}]) for t in topics]
            reqs = [
                Request(f"s{i}", p, n, GREEDY)
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
            texts, _, _ = run(e, reqs)
            again, redone, _ = run(e, [Request("s1-again", prompts[1], 2, GREEDY)])
            reused = redone["s1-again"].usage["cached_tokens"] == len(prompts[1]) - 1
            # Returning conversations go back to their slots: arrival order 5, 0, 2.
            run(e, [Request(f"back{i}", prompts[i], 8, GREEDY) for i in (5, 0, 2)])
            return texts, layouts, reused and again["s1-again"] == texts["s1"]
        finally:
            e.close()

    texts, layouts, cache_kept = serve(fill=True)
    with_fillers = 0
    for ids in layouts:
        runs = [k for j, k in enumerate(ids) if j == 0 or k != ids[j - 1]]
        assert runs == list(range(runs[0], runs[0] + len(runs))), ids
        with_fillers += {0, 2, 5} <= set(ids) and len(ids) == 6
    assert with_fillers > 10  # the steps after slots 1, 3 and 4 went idle
    assert cache_kept  # an idle slot's cache is whole again after its fillers
    unfilled, plain_layouts, _ = serve(fill=False)
    assert any(ids == [0, 2, 5] for ids in plain_layouts)  # what the fillers replace
    assert texts == unfilled


# ---- structured outputs -----------------------------------------------------------------------


def grammar_takes(engine, schema: dict, text: str, whole: bool = False) -> bool:
    """Whether the grammar made from `schema` lets the model write `text` (whole: and end
    there), token by token through llama.cpp's grammar sampler (each token is checked
    before it is accepted: a token the grammar refuses, once accepted, aborts the process;
    the end is the end-of-generation token)."""
    import ctypes
    import json

    import llama_cpp as L

    from workers.engine.grammar import grammar_for_schema

    grammar = engine._grammar_sampler(grammar_for_schema(json.dumps(schema)))
    end = [L.llama_vocab_eos(engine.vocab)] if whole else []
    try:
        for token in engine.tokenize(text, False, False) + end:
            one = (L.llama_token_data * 1)(L.llama_token_data(token, 1.0, 0.0))
            L.llama_sampler_apply(
                grammar, ctypes.byref(L.llama_token_data_array(one, 1, -1, False))
            )
            if one[0].logit == float("-inf"):
                return False
            L.llama_sampler_accept(grammar, token)
        return True
    finally:
        L.llama_sampler_free(grammar)


def test_a_json_string_refuses_raw_control_characters(engine):
    """JSON forbids a raw newline inside a string, and so does the grammar (llama-cpp-
    python's converter allowed one, and a stream moved to another replica once wrote it,
    which a JSON parser then refused); a plain character still goes in."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert grammar_takes(engine, schema, '{"a": "xy')
    assert not grammar_takes(engine, schema, '{"a": "x\n')
    assert not grammar_takes(engine, schema, '{"a": "x\t')


def test_a_character_beyond_u_ffff_written_as_two_escapes_is_one_character(engine):
    """JSON may write a character beyond U+FFFF as itself or as a pair of \\u escapes;
    minLength and maxLength count it once either way, as JSON Schema counts characters
    (llama.cpp's string character took the pair for two), and the escape of a lone
    surrogate, which decodes to no character, is refused."""
    pair = '"\\ud83d\\ude00"'  # the JSON text "\ud83d\ude00": one emoji
    assert grammar_takes(engine, {"type": "string", "maxLength": 1}, pair, whole=True)
    assert grammar_takes(engine, {"type": "string", "maxLength": 1}, '"\U0001f600"', whole=True)
    assert not grammar_takes(engine, {"type": "string", "maxLength": 1}, '"ab"', whole=True)
    assert not grammar_takes(engine, {"type": "string", "minLength": 2}, pair, whole=True)
    longer = '"\\ud83d\\ude00\\u00e9"'
    assert grammar_takes(engine, {"type": "string", "minLength": 2}, longer, whole=True)
    for lone in ['"\\ud83d"', '"\\ude00"', '"\\ud83dx"']:
        assert not grammar_takes(engine, {"type": "string"}, lone, whole=True), lone


def test_additional_properties_cannot_repeat_a_declared_one(engine):
    """With additionalProperties, an extra key may be anything but a declared name: else
    the model could write a declared property twice, the second time with a value its own
    schema refuses (llama-cpp-python's converter allowed it). Names that start one another
    and characters special in a character class are covered."""
    names = ["n", "nb", "]-^"]
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "string"},
            "nb": {"type": "integer"},
            "]-^": {"type": "integer"},
        },
        "required": names,
        "additionalProperties": {"type": "integer"},
    }
    head = '{"n": "x", "nb": 1, "]-^": 1, '
    for name in names:
        assert not grammar_takes(engine, schema, f'{head}"{name}":'), name
    for name in ["nc", "nbb", "m", "]-", "]-^x", "é", ""]:
        assert grammar_takes(engine, schema, f'{head}"{name}": 2'), name


#: (pattern, values): whether the grammar takes each value's JSON must be whether the pattern
#: matches it, as JSON Schema means it (anywhere in the string unless anchored; ECMA-262's
#: \\d, \\w, \\s: Python's with re.ASCII for these values).
PATTERNS = [
    (r"^\d{3}-\d{4}$", ["555-1234", "555-12345", "5551234", "555-123", "555-12a4"]),
    (r"^\w+@\w+\.com$", ["me@example.com", "me@examplexcom", "me@example.comx", "@x.com"]),
    ("^yes|no$", ["yes", "yes sir", "uh no", "maybe", "no way"]),
    ("[0-9]+", ["room 101 now", "101", "no digits"]),
    ("^(?:ab)+$", ["abab", "aba", ""]),
    ("^[^a-z]+$", ['A"B\\C\nD', "AbC", ""]),
    ("^.{2,5}$", ['a"', "a\\b", "a\nb", "abcdef", "x"]),
    (r"^a\\b$", ["a\\b", "a\bb", "ab"]),
    ('^say "x"$', ['say "x"', "say x"]),
    (r"^(?<year>\d{4})-(0[1-9]|1[0-2])$", ["2026-12", "2026-13", "26-12"]),
    ("^(a?)*$", ["aaa", "", "b"]),
    ("^$", ["", " "]),
]


def test_a_pattern_takes_exactly_the_strings_it_matches(engine):
    """A string's `pattern` holds the decoded value, not the JSON text. llama-cpp-python's
    converter pasted the regular expression into the JSON text: "^[^a-z]+$" let a raw
    quote end the string early, "\\d{3}-\\d{4}" repeated "-\\d" four times in a grammar
    llama.cpp cannot parse, "^yes|no$" lost its quotes, and it refused unanchored patterns
    and "(?:" (each seen here)."""
    import json
    import re

    for pattern, values in PATTERNS:
        schema = {"type": "string", "pattern": pattern}
        for value in values:
            text = json.dumps(value, ensure_ascii=False)
            expected = re.search(pattern.replace("(?<", "(?P<"), value, re.ASCII) is not None
            assert grammar_takes(engine, schema, text, whole=True) == expected, (pattern, value)


#: (pattern, minLength, maxLength, values tried).
LENGTHS = [
    ("^[A-Z]+$", 2, 4, ["A", "AB", "ABCD", "ABCDE", "ab"]),
    (r"^[A-Z]{2}\d+$", 0, 5, ["AB1", "AB123", "AB1234", "A12"]),
    (r"\d+", 0, 4, ["a1", "12b4", "x1y2z", "abc", "1234"]),
    ("^(ab|c)+$", 3, 4, ["abc", "cab", "cc", "abab", "ababc", "ccccc"]),
    ("^.*$", 3, None, ["ab", "abc", 'a"b\\c']),
    ("^x", 2, 3, ["x", "xy", "xyz", "xyzw", "yx"]),
]


def test_lengths_beside_a_pattern_hold(engine):
    """minLength and maxLength beside a pattern: both converters keep the pattern alone (a
    tag of at most 4 capitals could run on); here the grammar takes exactly the matching
    strings of those lengths."""
    import json
    import re

    for pattern, least, most, values in LENGTHS:
        schema = {"type": "string", "pattern": pattern, "minLength": least}
        if most is not None:
            schema["maxLength"] = most
        for value in values:
            text = json.dumps(value, ensure_ascii=False)
            fits = least <= len(value) <= (len(value) if most is None else most)
            expected = fits and re.search(pattern, value, re.ASCII) is not None
            assert grammar_takes(engine, schema, text, whole=True) == expected, (schema, value)


def test_a_length_bound_too_large_to_write_leaves_the_pattern(engine):
    """GBNF written inline shares no part: at most 40 characters of "(ab|c)+" would take an
    exponential grammar, so the pattern alone holds there, as in both converters."""
    import json

    schema = {"type": "string", "pattern": "^(ab|c)+$", "maxLength": 40}
    assert grammar_takes(engine, schema, json.dumps("ab" * 30), whole=True)
    assert not grammar_takes(engine, schema, json.dumps("abb"), whole=True)
    schema["maxLength"] = 6  # small enough to write
    assert not grammar_takes(engine, schema, json.dumps("abababab"), whole=True)


def test_lengths_no_matching_string_can_have_are_refused():
    import json

    from workers.engine.grammar import grammar_for_schema

    for extra, what in [
        ({"pattern": r"^\d{3}$", "maxLength": 2}, "matches no string of 0 to 2 characters"),
        ({"pattern": "^a+$", "minLength": 3, "maxLength": 2}, "at least 3 and at most 2"),
        ({"pattern": "^a+$", "maxLength": -1}, "maxLength must be a whole number"),
        ({"pattern": "^a+$", "minLength": "2"}, "minLength must be a whole number"),
    ]:
        with pytest.raises(EngineError) as err:
            grammar_for_schema(json.dumps({"type": "string", **extra}))
        assert err.value.code == codes.INVALID_SCHEMA, extra
        assert what in err.value.message, err.value.message


def test_what_a_pattern_cannot_say_in_a_grammar_is_refused_by_name():
    """Look-arounds, back-references, word boundaries and flags are refused with what the
    grammar cannot express (llama.cpp's converter accepts any string instead, which ignores
    the schema without a word)."""
    import json

    from workers.engine.grammar import grammar_for_schema

    for pattern, what in [
        ("^(?=a)", "assert"),
        (r"(a)\1", "back-reference"),
        (r"\bx", "anchor"),
        ("(?i)abc", "flags"),
        ("^[a-", "not a regular expression"),
        ("^a{2000}$", "more than 1000"),
    ]:
        with pytest.raises(EngineError) as err:
            grammar_for_schema(json.dumps({"type": "string", "pattern": pattern}))
        assert err.value.code == codes.INVALID_SCHEMA, pattern
        assert pattern in err.value.message and what in err.value.message, err.value.message


def test_an_integers_bounds_hold(engine):
    """minimum, maximum and both drafts' exclusive bounds: the grammar takes exactly the
    integers in range, written as JSON writes them (llama-cpp-python's converter ignored
    the bounds: 7 was a rating of 1 to 5)."""
    big = 10**9
    cases = [  # (bounds, the lowest and highest integer they allow, values tried)
        ({"minimum": 1, "maximum": 5}, 1, 5, range(-3, 12)),
        ({"minimum": 15, "exclusiveMaximum": 234.5}, 15, 234, [*range(40), *range(190, 300)]),
        ({"minimum": -12, "maximum": -3}, -12, -3, range(-20, 4)),
        ({"exclusiveMinimum": -7}, -6, big, [*range(-12, 12), big, -big]),
        ({"maximum": 10, "exclusiveMaximum": True}, -big, 9, [*range(-12, 14), -big]),
    ]
    for bounds, lo, hi, values in cases:
        schema = {"type": "integer", **bounds}
        for v in values:
            assert grammar_takes(engine, schema, str(v), whole=True) == (lo <= v <= hi), (bounds, v)
        assert not grammar_takes(engine, schema, "01", whole=True)  # no leading zero


def test_a_numbers_bounds_hold(engine):
    """A bounded number (a confidence from 0 to 1, a rating from 0.5 to 5, a price above
    0.25) takes exactly the numbers in range, without an exponent; neither converter
    bounds numbers (llama-cpp-python's grammar took 1.5 as a confidence)."""
    from decimal import Decimal as D

    values = ["0", "0.5", "1", "1.0", "1.5", "-0.5", "-2", "-2.0", "-2.5", "-5", "-5.5", "0.0"]
    values += ["-3", "-4.99", "7", "12.25", "1e2", "0.25", "0.250", "0.2500001", "0.24999"]
    values += ["0.75", "0.7500", "0.75001", "0.7", "-0.05", "-0.049", "-0.051", "0.123"]
    values += ["0.129", "0.1291", "0.1289", "0.12", "0.13", "0.4999", "5.0", "5.01", "4.99"]
    for bounds, allowed in [
        ({"minimum": 0, "maximum": 1}, lambda v: 0 <= v <= 1),
        ({"exclusiveMinimum": 0}, lambda v: v > 0),
        ({"minimum": -5, "exclusiveMaximum": -2}, lambda v: -5 <= v < -2),
        ({"maximum": 1, "exclusiveMaximum": True, "minimum": -3}, lambda v: -3 <= v < 1),
        ({"minimum": 0.5, "maximum": 5}, lambda v: D("0.5") <= v <= 5),
        ({"exclusiveMinimum": 0.25, "maximum": 0.75}, lambda v: D("0.25") < v <= D("0.75")),
        ({"minimum": -1.5, "exclusiveMaximum": -0.05}, lambda v: D("-1.5") <= v < D("-0.05")),
        ({"minimum": 0.123, "maximum": 0.129}, lambda v: D("0.123") <= v <= D("0.129")),
    ]:
        schema = {"type": "number", **bounds}
        for text in values:
            expected = "e" not in text and allowed(D(text))
            assert grammar_takes(engine, schema, text, whole=True) == expected, (bounds, text)


def test_generated_strings_match_their_patterns(engine):
    """Sampled under the grammar, at a temperature, each answer parses, each string
    matches its pattern and each number keeps its bounds."""
    import json
    import re
    from decimal import Decimal

    from workers.engine.grammar import grammar_for_schema

    schema = {
        "type": "object",
        "properties": {
            "phone": {"type": "string", "pattern": r"^\d{3}-\d{4}$"},
            "code": {"type": "string", "pattern": r"^[A-Z]{2}[^a-z]{1,6}$"},
            "note": {"type": "string", "pattern": "^.{1,12}$"},
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "price": {"type": "number", "exclusiveMinimum": 0.25, "maximum": 0.75},
            "tag": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
        },
        "required": ["phone", "code", "note", "stars", "confidence", "price", "tag"],
    }
    prompt = chat_tokens(engine, [{"role": "user", "content": "A contact as JSON."}])
    grammar = grammar_for_schema(json.dumps(schema))
    texts, done, errors = run(
        engine,
        [
            Request(f"p{i}", prompt, 160, Sampling(temperature=1.0, seed=i, grammar=grammar))
            for i in range(4)
        ],
    )
    assert not errors
    for i in range(4):
        assert done[f"p{i}"].reason == "stop", texts[f"p{i}"]
        got = json.loads(texts[f"p{i}"], parse_float=Decimal)
        for name, prop in schema["properties"].items():
            if "pattern" in prop:
                assert re.search(prop["pattern"], got[name], re.ASCII), (name, got)
        assert got["stars"] in range(1, 6) and 0 <= got["confidence"] <= 1, got
        assert Decimal("0.25") < got["price"] <= Decimal("0.75"), got
        assert 2 <= len(got["tag"]) <= 4, got


def test_a_json_schema_grammar_shapes_the_output(engine):
    import json

    from pydantic import BaseModel

    from workers.engine.grammar import grammar_for_schema

    class Person(BaseModel):
        name: str
        age: int

    schema = json.dumps(Person.model_json_schema())
    prompt = chat_tokens(engine, [{"role": "user", "content": "Describe a person as JSON."}])
    texts, done, errors = run(
        engine,
        [
            Request(
                f"j{i}",
                prompt,
                60,
                Sampling(temperature=t, seed=i, grammar=grammar_for_schema(schema)),
            )
            for i, t in enumerate((0.0, 0.9, 0.9))
        ]
        + [Request("free", prompt, 20, Sampling(temperature=0.0))],  # in the same batches
    )
    assert not errors
    for i in range(3):
        assert done[f"j{i}"].reason == "stop", texts[f"j{i}"]  # the grammar ended it, not the limit
        Person.model_validate_json(texts[f"j{i}"])  # parses and matches
    assert not texts["free"].lstrip().startswith("{")  # the others are not constrained


def test_enum_and_const_values_come_out_as_their_json(engine):
    """A value the schema fixes is written as its JSON text, whatever characters it holds:
    llama-cpp-python's converter left backslashes unescaped in the grammar, so a quote cut
    the literal short and an escaped newline became a raw one, which JSON forbids. Non-ASCII
    characters come out as themselves, as llama.cpp writes them, not as \\u escapes."""
    import json

    from workers.engine.grammar import grammar_for_schema

    values = ['say "hi"', "C:\\temp", "two\nlines", "café"]
    schema = {
        "type": "object",
        "properties": {
            **{f"e{i}": {"enum": [v]} for i, v in enumerate(values)},
            'k"\\': {"const": "x"},  # a property name needing escapes
            "größe": {"const": "😀"},
        },
        "required": [*(f"e{i}" for i in range(len(values))), 'k"\\', "größe"],
    }
    prompt = chat_tokens(engine, [{"role": "user", "content": "Answer in JSON."}])
    texts, done, errors = run(
        engine,
        [
            Request(
                "c",
                prompt,
                120,
                Sampling(temperature=0.0, grammar=grammar_for_schema(json.dumps(schema))),
            )
        ],
    )
    assert not errors and done["c"].reason == "stop", texts["c"]
    assert json.loads(texts["c"]) == {
        **{f"e{i}": v for i, v in enumerate(values)},
        'k"\\': "x",
        "größe": "😀",
    }, texts["c"]
    for text in ("café", "größe", "😀"):  # as themselves, not spelled as \u escapes
        assert text in texts["c"], texts["c"]


def test_a_schema_the_grammar_cannot_express_is_refused_by_name(engine):
    from workers.engine.grammar import grammar_for_schema

    with pytest.raises(EngineError) as err:
        grammar_for_schema('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
    assert err.value.code == codes.INVALID_SCHEMA and "nowhere" in err.value.message
    with pytest.raises(EngineError) as err:
        engine.submit(Request("g", [1, 2], 5, Sampling(grammar="root ::= (")))
    assert err.value.code == codes.INVALID_SCHEMA


def test_logprobs_are_the_models_own_log_probabilities(engine):
    import math

    prompt = chat_tokens(engine)
    texts, done, errors, logprobs = run(
        engine,
        [
            Request("lp", prompt, 8, Sampling(temperature=0.0), logprobs=3),
            Request("no", prompt, 8, Sampling(temperature=0.0)),
        ],
        collect_logprobs=True,
    )
    entries = logprobs["lp"]
    assert len(entries) == done["lp"].usage["completion_tokens"] > 0 and logprobs["no"] == []
    for token, piece, lp, top in entries:
        assert lp <= 0 and len(top) == 3 and piece == engine.token_bytes(token)
        assert sum(math.exp(x) for _, x in top) <= 1 + 1e-6
        # Greedy: the chosen token is the likeliest, and the first alternative is itself.
        assert top[0] == (piece, lp) and all(top[i][1] >= top[i + 1][1] for i in range(2))
    assert b"".join(e[1] for e in entries).decode() == texts["lp"]


def test_the_flash_attention_setting_reaches_llama_cpp(smollm2_path):
    """auto is on where the backend has it (the CPU backend does), off computes attention
    the other way: the first tokens' log probabilities show which one ran."""
    first = {}
    for mode in ("auto", "on", "off"):
        e = BatchEngine(
            str(smollm2_path), context_length=512, parallel=2, threads=2, flash_attn=mode
        )
        try:
            _, _, _, logprobs = run(
                e,
                [Request("a", chat_tokens(e), 4, Sampling(temperature=0.0), logprobs=1)],
                collect_logprobs=True,
            )
        finally:
            e.close()
        first[mode] = [entry[2] for entry in logprobs["a"]]
    assert first["auto"] == first["on"]
    assert first["off"] != first["on"]
    assert max(abs(a - b) for a, b in zip(first["off"], first["on"], strict=True)) < 0.1


def test_the_invariant_mode_keeps_flash_attention_off_and_a_bad_setting_is_refused(smollm2_path):
    e = BatchEngine(
        str(smollm2_path),
        context_length=128,
        parallel=1,
        threads=2,
        batch_invariant=True,
        flash_attn="on",
    )
    try:
        assert e.flash_attn == "off"  # solo runs' numerics
    finally:
        e.close()
    with pytest.raises(EngineError) as err:
        BatchEngine(str(smollm2_path), 128, 1, 2, flash_attn="fast")
    assert err.value.code == codes.INVALID_ARGUMENT and "auto, on, off" in err.value.message


def test_n_choices_evaluate_the_prompt_once_and_sample_apart(engine):
    decoded = []
    real = engine._decode

    def counting(n, events):
        decoded.append(n)
        return real(n, events)

    engine._decode = counting
    try:
        prompt = chat_tokens(engine, [{"role": "user", "content": "Write a poem about rain."}])
        texts, done, errors = run(
            engine, [Request("r", prompt, 24, Sampling(temperature=1.0, seed=7), n=3)]
        )
    finally:
        engine._decode = real
    assert not errors and set(done) == {"r", "r#1", "r#2"}
    generated = sum(done[k].usage["completion_tokens"] for k in done)
    # The prompt was decoded once; every later token once per choice.
    assert sum(decoded) <= len(prompt) + generated
    assert len({texts[k] for k in done}) == 3  # three samples, three texts
    with pytest.raises(EngineError, match="slots"):
        engine.submit(Request("too-many", prompt, 4, Sampling(), n=5))


def test_a_host_entry_carries_its_window_checkpoints_and_sheds_them_before_entries():
    """Under the window cache an entry keeps only its conversation's last window; the
    window checkpoints its slot made go with it (llama-server's cache-ram entries carry
    theirs), so a prompt that goes back to one (a regenerate, an edit) is served from the
    entry. They count against the limit, and go before any entry when room runs out: an
    entry serves its conversation's next turn, a checkpoint only a regenerate or an edit."""
    from workers.engine.core import _WindowCheckpoint

    def checkpoint(n: int, size: int = 50) -> _WindowCheckpoint:
        # Made when the sequence held n tokens: its cells reach back n_swa - 1 positions.
        return _WindowCheckpoint(n, data(size), size, low=n - 8)

    cache = HostCache(limit_bytes=400)
    conversation = list(range(100, 140))  # 40 tokens; a window of 8
    cache.add(conversation, data(100))
    assert cache.reserve(50) and cache.reserve(50)  # the slot's two, counted beside it
    start, end = checkpoint(20), checkpoint(30)
    assert not cache.attach([7, 7], [start])  # no entry holds those tokens
    assert cache.attach(conversation, [start, end]) and cache.bytes == 200
    assert cache.entries[0].checkpoints == [start, end] and cache.entries[0].held == 200
    # Not its end, so the entry's own cells serve no prompt. The prompt that ended at 30
    # sent again (its answer regenerated) reads its last token only, from the checkpoint
    # of 30; a prompt edited after token 25, from the one of 20; one edited after 15, none.
    # (The engine asks with all but a prompt's last token: its logits give the first new.)
    assert cache.best(conversation[:29], than=0, n_swa=8) == (cache.entries[0], 29, end)
    assert cache.best(conversation[:25], than=0, n_swa=8) == (cache.entries[0], 20, start)
    assert cache.best(conversation[:15], than=0, n_swa=8) == (None, 0, None)
    assert cache.best(conversation[:29], than=29, n_swa=8) == (None, 29, None)  # a slot's
    # A longer copy of the same conversation takes them over; a duplicate goes.
    cache.reserve(50)
    cache.add(conversation + [1, 2], data(100))
    assert [e.tokens[-1] for e in cache.entries] == [2] and cache.bytes == 250
    assert cache.attach(conversation, [checkpoint(30)]) and cache.bytes == 200
    assert [c.n for c in cache.entries[0].checkpoints] == [20, 30]
    # Room: the checkpoints go first, oldest entry first, then the entries.
    cache.add([5] * 10, data(100))
    assert cache.reserve(50) and cache.attach([5] * 10, [checkpoint(9)])
    assert cache.bytes == 350
    cache.add([6] * 10, data(100))  # 100 more: the oldest entry's oldest checkpoint goes
    assert [[c.n for c in e.checkpoints] for e in cache.entries] == [[30], [9], []]
    assert cache.bytes == 400
    cache.add([7] * 10, data(150))  # 150 more: the other checkpoints, then an entry
    assert [(e.tokens[0], e.checkpoints) for e in cache.entries] == [(5, []), (6, []), (7, [])]
    assert cache.bytes == 350
    # Restored into a slot, an entry hands its checkpoints over, still counted.
    assert cache.reserve(50) and cache.attach([7] * 10, [checkpoint(9)])
    given = cache.take(cache.entries[-1])
    assert [c.n for c in given] == [9] and cache.bytes == 400  # its data is the spare now
    cache.release(50)
    assert cache.bytes == 350
