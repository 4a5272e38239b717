"""What the agent and an engine process say to each other over their pipe.

Small picklable records, matched by type (`match msg: case Token(): ...`), never read by
position. Agent -> engine: Generate, Cancel, Tokenize, Embed, Threads, Shutdown. Engine -> agent:
Ready or LoadError once, then Token, Done and Error events of generations (one Batch per
decode step carries that step's events together), Tokens and Embeddings answers, and
CacheSize when the host-RAM prompt cache grew while no request ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ---- agent -> engine -------------------------------------------------------------------


@dataclass(slots=True)
class Generate:
    id: str
    payload: dict


@dataclass(slots=True)
class Cancel:
    id: str


@dataclass(slots=True)
class Tokenize:
    id: str
    payload: dict


@dataclass(slots=True)
class Embed:
    id: str
    texts: list[str]


@dataclass(slots=True)
class Threads:
    """Decode with n threads from the next step on (the agent shares its cores among the
    engines that are busy)."""

    n: int


@dataclass(slots=True)
class Shutdown:
    pass


# ---- engine -> agent -------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    info: dict


@dataclass(slots=True)
class LoadError:
    code: int  # an ErrorCode value
    message: str


@dataclass(slots=True)
class Token:
    """A piece of text; `id` is the request's, with "#k" for its choice k > 0."""

    id: str
    text: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    #: (token id, piece, logprob, [(piece, logprob) of the top alternatives]) per token
    logprobs: list = field(default_factory=list)


@dataclass(slots=True)
class Done:
    id: str
    reason: str  # "stop", "length" or "cancelled"
    usage: dict  # prompt_tokens, completion_tokens, cached_tokens
    timings: dict  # time_to_first_token, decode_seconds, queue_seconds


@dataclass(slots=True)
class Error:
    id: str
    code: int  # an ErrorCode value
    message: str


@dataclass(slots=True)
class Tokens:
    id: str
    tokens: list[int]
    context_length: int


@dataclass(slots=True)
class Embeddings:
    id: str
    vectors: list[list[float]]
    n_tokens: int


@dataclass(slots=True)
class CacheSize:
    """Bytes the host-RAM prompt cache holds, sent after an idle engine copied slots there
    (save_ahead): a Done carries the count too, but none may come for a long while."""

    bytes: int


@dataclass(slots=True)
class Batch:
    events: list  # Token, Done and Error events of one decode step


#: Events that belong to one request's stream.
StreamEvent = Token | Done | Error | Tokens | Embeddings
