"""GGUF files the tests make from the bundled SmolLM2, with the gguf library:

- a multi-file (split) copy, in llama.cpp's gguf-split layout (the first part holds every
  key, each part holds split.no, split.count and split.tensors.count);
- an F16 source for quantization, its weights dequantized from the Q4_1 file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def _copy_keys(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, overrides: dict) -> None:
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if field.name in overrides:
            writer.add_key_value(field.name, overrides[field.name], vtype, sub_type=sub)
        else:
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def rewrite(src: Path, dst: Path, *, parts: int = 1, f16: bool = False) -> list[Path]:
    """Copy `src` to `dst` (split into `parts` files named as llama.cpp's gguf-split names
    them), optionally with every quantized weight dequantized to F16. Returns the files."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    per_part = -(-len(reader.tensors) // parts) if parts > 1 else 0
    writer = gguf.GGUFWriter(str(dst), arch, split_max_tensors=per_part)
    overrides = {"general.file_type": int(gguf.LlamaFileType.MOSTLY_F16)} if f16 else {}
    _copy_keys(reader, writer, overrides)
    for t in reader.tensors:
        quantized = t.tensor_type not in (
            gguf.GGMLQuantizationType.F32,
            gguf.GGMLQuantizationType.F16,
        )
        if f16 and quantized:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if parts == 1:
        return [dst]
    stem = dst.name.removesuffix(".gguf")
    return [dst.with_name(f"{stem}-{i + 1:05d}-of-{parts:05d}.gguf") for i in range(parts)]
