"""Facts about a GGUF file, read with the `gguf` package (no llama.cpp needed)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf


class BadGGUF(ValueError):
    """The file is not a complete, readable GGUF model."""


_BLOCK = re.compile(r"^blk\.(\d+)\.")
#: llama.cpp's split naming (gguf-split, llama_split_path): the first part is loaded and
#: llama.cpp finds the others beside it by this pattern.
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_name(stem: str, index: int, count: int) -> str:
    """The name llama.cpp expects for part `index` (0-based) of `count`."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}.gguf"


def split_siblings(path: str | Path) -> list[Path]:
    """All parts of the split a file belongs to, in order (just the file when not a split)."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(split_part_name(m.group("stem"), i, count)) for i in range(count)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise BadGGUF(f"split parts missing beside {path.name}: {', '.join(missing)}")
    return parts


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:
        return None


def _open(path: Path) -> gguf.GGUFReader:
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises a variety of errors on bad input
        # The reader maps tensors as it parses, so a short file fails inside it.
        raise BadGGUF(
            f"{path.name} is not a readable GGUF file (truncated or corrupt): {exc}"
        ) from exc
    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise BadGGUF(f"{path.name} is truncated: tensors need {end} bytes, the file has {size}")
    return reader


#: Sliding-window architectures as llama.cpp loads them (src/models/<arch>.cpp): every
#: n-th layer attends to everything, the others to the window, unless the file says
#: otherwise (`<arch>.attention.sliding_window_pattern`, a period or one flag per layer);
#: and the window when the file gives none. Others with a window count no sliding layers,
#: so the planner sizes their KV as full (an upper bound).
SWA_PATTERNS = {
    "gemma2": 2,
    "gemma3": 6,
    "gemma3n": 5,
    "gemma-embedding": 6,
    "cohere2": 4,
    "gpt-oss": 2,
    "olmo2": 4,
}
SWA_DEFAULT_WINDOW = {"gemma2": 4096}


def _sliding(reader: gguf.GGUFReader, arch: str, n_layers: int) -> tuple[int, str]:
    """(window, pattern): the pattern has a character a layer, "1" where it attends only
    to the window, as llama.cpp's set_swa_pattern lays them out ("" without a window)."""
    window = int(
        _field(reader, f"{arch}.attention.sliding_window") or SWA_DEFAULT_WINDOW.get(arch, 0)
    )
    if not window or not n_layers:
        return window, ""
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer
        flags = [bool(x) for x in pattern[:n_layers]]
        flags += [False] * (n_layers - len(flags))
    else:
        period = int(pattern) if pattern is not None else SWA_PATTERNS.get(arch)
        if period is None:
            flags = [False] * n_layers
        elif period == 0:
            flags = [True] * n_layers
        elif arch in SWA_PATTERNS:  # the full layer last in each period
            flags = [i % period < period - 1 for i in range(n_layers)]
        else:
            # Some architectures put the full layer first in each period: a layer counts
            # as sliding only where it slides in both layouts (its KV never underestimated).
            flags = [0 < i % period < period - 1 for i in range(n_layers)]
    return window, "".join("1" if f else "0" for f in flags)


def _check_split(readers: list[gguf.GGUFReader]) -> None:
    """The parts are one split, complete and in order (what llama.cpp will check on load)."""
    count = int(_field(readers[0], "split.count") or 1)
    if count != len(readers):
        raise BadGGUF(f"the first part says split.count={count}, {len(readers)} parts given")
    for i, r in enumerate(readers):
        no = _field(r, "split.no")
        if count > 1 and (no is None or int(no) != i):
            raise BadGGUF(f"part {i + 1} does not say split.no={i}")
    declared = _field(readers[0], "split.tensors.count")
    found = sum(len(r.tensors) for r in readers)
    if declared is not None and int(declared) != found:
        raise BadGGUF(f"the split declares {declared} tensors, its parts hold {found}")


def read_metadata(paths: str | Path | list) -> dict:
    """Architecture, shape and per-layer byte counts of a GGUF model (one file, or every part
    of a split in order); raises BadGGUF."""
    paths = [Path(p) for p in paths] if isinstance(paths, list | tuple) else [Path(paths)]
    readers = [_open(p) for p in paths]
    _check_split(readers)
    reader = readers[0]  # the first part carries every key; the others only split.*
    tensors = [t for r in readers for t in r.tensors]
    arch = _field(reader, "general.architecture")
    if not arch:
        raise BadGGUF("general.architecture is missing")
    n_layers = int(_field(reader, f"{arch}.block_count") or 0)
    per_layer = [0] * n_layers
    other = 0
    sizes = {}
    for t in tensors:
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) < n_layers:
            per_layer[int(m.group(1))] += int(t.n_bytes)
        else:
            other += int(t.n_bytes)
            sizes[t.name] = int(t.n_bytes)
    embeddings = sizes.get("token_embd.weight", 0)
    # Without its own output matrix a model reuses the embeddings (tied), and llama.cpp
    # copies them to the device that computes the logits.
    output = sizes.get("output.weight", embeddings) + sizes.get("output_norm.weight", 0)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    file_type = _field(reader, "general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        quantization = str(file_type or "unknown")
    n_heads = int(_field(reader, f"{arch}.attention.head_count") or 0)
    window, sliding_pattern = _sliding(reader, str(arch), n_layers)
    n_embd = int(_field(reader, f"{arch}.embedding_length") or 0)
    return {
        "architecture": str(arch),
        "display_name": str(_field(reader, "general.name") or ""),
        "parameters": int(sum(int(t.n_elements) for t in tensors)),
        "quantization": quantization,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or n_heads),
        "n_embd": n_embd,
        "head_dim": int(
            _field(reader, f"{arch}.attention.key_length") or (n_embd // n_heads if n_heads else 0)
        ),
        "context_length": int(_field(reader, f"{arch}.context_length") or 0),
        "bytes_per_layer": per_layer,
        "bytes_outside_layers": other,
        "bytes_embeddings": embeddings,
        "bytes_output": output,
        "n_vocab": int(_field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)),
        "n_ff": int(_field(reader, f"{arch}.feed_forward_length") or 0),
        "sliding_window": window,
        "sliding_layers": sliding_pattern.count("1"),
        "sliding_pattern": sliding_pattern,
        "has_chat_template": _field(reader, "tokenizer.chat_template") is not None,
    }
