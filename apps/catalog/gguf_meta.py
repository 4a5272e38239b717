"""Facts about a GGUF file, read with the `gguf` package (no llama.cpp needed)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf


class BadGGUF(ValueError):
    """The file is not a complete, readable GGUF model."""


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:
        return None


def read_metadata(path: str | Path) -> dict:
    """Architecture, shape and per-layer byte counts of a GGUF file; raises BadGGUF."""
    path = Path(path)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises a variety of errors on bad input
        # The reader maps tensors as it parses, so a short file fails inside it.
        raise BadGGUF(f"not a readable GGUF file (truncated or corrupt): {exc}") from exc
    arch = _field(reader, "general.architecture")
    if not arch:
        raise BadGGUF("general.architecture is missing")
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise BadGGUF(f"truncated: tensors need {end} bytes, the file has {size}")
    n_layers = int(_field(reader, f"{arch}.block_count") or 0)
    per_layer = [0] * n_layers
    other = 0
    sizes = {}
    for t in reader.tensors:
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
    n_embd = int(_field(reader, f"{arch}.embedding_length") or 0)
    return {
        "architecture": str(arch),
        "display_name": str(_field(reader, "general.name") or ""),
        "parameters": int(sum(int(t.n_elements) for t in reader.tensors)),
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
        "sliding_window": int(_field(reader, f"{arch}.attention.sliding_window") or 0),
        "has_chat_template": _field(reader, "tokenizer.chat_template") is not None,
    }
