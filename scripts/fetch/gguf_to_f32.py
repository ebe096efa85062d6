#!/usr/bin/env python3
"""Rewrite a GGUF with every tensor dequantized to float32, metadata unchanged.

Usage: gguf_to_f32.py IN.gguf OUT.gguf

Why: `retrace bench` compares retrace against llama-server on the SAME weights. retrace's
SmolLM2 folder is the Q4_1 GGUF dequantized to f32 (scripts/fetch/gguf_to_hf.py, gguf.quants.dequantize);
this writes that same dequantization back in llama.cpp's own layout (names, Q/K row order and
shapes untouched), so llama-server computes in f32 from identical numbers. llama.cpp's
convert_hf_to_gguf.py would need torch, which this project avoids.
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, f in reader.fields.items():
        # The writer sets these itself (architecture is its constructor's argument).
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub)
    writer.add_key_value("general.file_type", 0, GGUFValueType.UINT32)  # 0 = ALL_F32
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF shapes are innermost-first; numpy's are outermost-first.
        data = data.reshape(tuple(int(d) for d in reversed(t.shape)))
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
